"""hvd_sparse.config read from HVD_SPARSE_* variables: a value it cannot take is refused at
``from_env_and_kwargs`` with a ValueError naming the option (docs/configuration.md), never
accepted to fail later where the runtime uses it. Each case below is a finding of the
config_env fuzz target (fuzz/config_env.py; its reproducers: fuzz/corpus/config_env/regress-*)."""
from __future__ import annotations

import pytest

from hvd_sparse import config

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_variables(monkeypatch):
    import os
    for k in list(os.environ):
        if k.startswith("HVD_SPARSE_"):
            monkeypatch.delenv(k)


def refused(monkeypatch, **env: str) -> str:
    for k, v in env.items():
        monkeypatch.setenv(f"HVD_SPARSE_{k.upper()}", v)
    with pytest.raises(ValueError) as e:
        config.from_env_and_kwargs()
    return str(e.value)


@pytest.mark.parametrize("option,value", [
    ("rto", "0._level"), ("timeout", "soon"), ("slots", "8.5"), ("block_size", "²"),
    ("auth", "maybe"), pytest.param("threads", "9" * 5000, id="threads-5000-digits")])
def test_a_value_that_does_not_parse_names_its_variable(monkeypatch, option, value):
    """int() and float() say "could not convert string to float: ..." and nothing more."""
    assert f"HVD_SPARSE_{option.upper()}" in refused(monkeypatch, **{option: value})


@pytest.mark.parametrize("option", ["timeout", "rto"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e999", "-inf"])
def test_timeouts_must_be_finite(monkeypatch, option, value):
    """NaN passed `<= 0` checks, and no timer or wait ends at infinity."""
    assert option in refused(monkeypatch, **{option: value})


@pytest.mark.parametrize("value", ["101.5.3gbit", ".", "1.2.3", "1e999", "1e999gbit"])
def test_a_link_rate_is_a_finite_number_named_when_refused(monkeypatch, value):
    assert "link_rate" in refused(monkeypatch, link_rate=value)


@pytest.mark.parametrize("option,value", [
    ("aggregators", "10.0.0.1:99999"), ("aggregators", "10.0.0.1:0"),
    ("aggregators", "10.0.0.1:9999,10.0.0.2:²"), ("aggregators", "10link_rate=9"),
    ("switch", "10.0.0.9:65536")])
def test_addresses_are_checked_up_front_with_ports_a_socket_takes(monkeypatch, option, value):
    """A port beyond 65535 was accepted and wrapped to 16 bits where the worker resolves it;
    the aggregator list was only parsed at init."""
    assert option in refused(monkeypatch, **{option: value})


@pytest.mark.parametrize("option,value", [
    ("threads", "-1"), ("small_bytes", "-5"), ("local_aggregators", "-2"), ("slots", "0"),
    ("metrics_records", "0"), ("block_size", "0")])
def test_a_value_out_of_range_names_its_variable_and_value(monkeypatch, option, value):
    """Negative counts were accepted; a refused value named its option, not its variable."""
    message = refused(monkeypatch, **{option: value})
    assert f"HVD_SPARSE_{option.upper()}={value!r}" in message and option in message, message


@pytest.mark.parametrize("value", ["DEBU$G", "10", "verbose"])
def test_log_level_is_a_level_name(monkeypatch, value):
    """logging.setLevel refused it at init, naming no option."""
    assert "log_level" in refused(monkeypatch, log_level=value)


def test_what_is_valid_still_parses(monkeypatch):
    for k, v in {"TIMEOUT": "60", "RTO": "0.01", "LINK_RATE": "10gbit", "LOG_LEVEL": "debug",
                 "AGGREGATORS": "10.0.0.1:9999, 10.0.0.2:1", "SWITCH": "10.0.0.9:65535",
                 "AUTH": "off", "PORTS": "20000-20100"}.items():
        monkeypatch.setenv(f"HVD_SPARSE_{k}", v)
    cfg = config.from_env_and_kwargs()
    assert (cfg.timeout, cfg.rto, cfg.auth, cfg.log_level) == (60.0, 0.01, False, "debug")
    assert cfg.aggregator_list() == [("10.0.0.1", 9999), ("10.0.0.2", 1)]
    assert cfg.switch_address() == ("10.0.0.9", 65535) and cfg.port_range() == (20000, 20100)


@pytest.mark.parametrize("value,want", [
    ("[fd00::1]:7777", [("fd00::1", 7777)]),
    ("[FD00:0::0:1]:1, 10.0.0.1:2", [("fd00::1", 1), ("10.0.0.1", 2)]),  # canonical text
    ("[::1]:9999,node-1:3", [("::1", 9999), ("node-1", 3)]),
    ("[::ffff:10.0.0.1]:5", [("::ffff:a00:1", 5)])])
def test_ipv6_aggregators_in_brackets(monkeypatch, value, want):
    monkeypatch.setenv("HVD_SPARSE_AGGREGATORS", value)
    monkeypatch.setenv("HVD_SPARSE_SWITCH", value.split(",")[0])
    cfg = config.from_env_and_kwargs()
    assert cfg.aggregator_list() == want and cfg.switch_address() == want[0]


@pytest.mark.parametrize("option", ["aggregators", "switch"])
@pytest.mark.parametrize("value,why", [
    ("fd00::1:7777", "takes brackets"),  # where the address ends would be a guess
    ("fd00::1", "takes brackets"), ("[fd00::1]", "expected"), ("[fd00::1]:", "expected"),
    ("[fd00::1]:0", "expected"), ("[fd00::g]:9", "expected"), ("[10.0.0.1]:9", "expected"),
    ("[]:9", "expected"), ("[fd00::1:9", "expected"), ("fd00::1]:9", "takes brackets"),
    ("[fe80::1]:9", "link-local"), ("[fd00::1%eth0]:9", "link-local"),
    ("node 1:9", "expected")])
def test_a_malformed_address_names_variable_value_and_what_is_accepted(monkeypatch, option,
                                                                      value, why):
    message = refused(monkeypatch, **{option: value})
    assert f"HVD_SPARSE_{option.upper()}={value!r}" in message, message
    assert why in message and "[fd00::1]:9999" in message, message


@pytest.mark.parametrize("value,want", [("fd00::1", "fd00::1"), ("[fd00::0:1]", "fd00::1"),
                                        ("10.0.0.1", "10.0.0.1"), ("node-1", "node-1")])
def test_aggregator_host_takes_a_bare_ipv6_literal(monkeypatch, value, want):
    """An address without a port: a bare IPv6 literal is unambiguous there."""
    monkeypatch.setenv("HVD_SPARSE_AGGREGATOR_HOST", value)
    assert config.from_env_and_kwargs().aggregator_host == want


@pytest.mark.parametrize("value", ["fd00::zz", "[fd00::1", "fe80::1", "a b"])
def test_aggregator_host_refused_names_its_variable(monkeypatch, value):
    message = refused(monkeypatch, aggregator_host=value)
    assert f"HVD_SPARSE_AGGREGATOR_HOST={value!r}" in message, message


def test_format_address_brackets_ipv6_only():
    assert config.format_address("fd00::1", 9) == "[fd00::1]:9"
    assert config.format_address("10.0.0.1", 9) == "10.0.0.1:9"
    assert config.format_address("node", 9) == "node:9"
