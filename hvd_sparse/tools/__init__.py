"""Tools around the runtime, which a training job never imports: the ``hvd-sparse`` command
(cli), the run-file analyzer, the packet builder and dissector, and the emulated-hosts testbed;
``lab``, the helpers scripts/ and tests/ share (not in the wheel).
Torch-free where they can be: an aggregator or switch host needs neither torch nor Horovod."""
