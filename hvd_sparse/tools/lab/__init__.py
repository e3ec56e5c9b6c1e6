"""The helpers that scripts/ and tests/ share: benchmark reporting (``report``: a table, a JSON
record, a PNG), block-sparse inputs (``inputs``), the DLRM-like model (``dlrm``), the
convergence suite's tasks and rank side (``accuracy``, ``python -m hvd_sparse.tools.lab.accuracy``
under horovodrun) and the demo's report (``demo_report``).

Lab code, not the product: it needs the development set-up's packages (rich, matplotlib,
scikit-learn, Horovod), and the wheel leaves it out (setup.py). A checkout installed editable
(``make build``, ``make dev``, the Docker images) imports it from here, as does any Python that
has the checkout on its path, so a script imports it wherever it is run from (directly, under
horovodrun, mpirun or torchrun, on the testbeds) without editing ``sys.path``.
"""
