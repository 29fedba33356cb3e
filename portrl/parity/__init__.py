"""Cross-hardware parity: op and algorithm cases against a float64 reference, goldens and their replay,
the end-to-end envelope, and the cross-backend matrix. Thresholds: :mod:`portrl.parity.tolerances`.

Modules: ``runner`` (``run_ops_parity``: the op and algorithm cases of ``ops_cases`` / ``algo_cases``),
``golden`` (``record_golden`` / ``replay_golden``), ``e2e`` (the training-curve envelope), ``compare``
(the cross-backend matrix), ``metrics`` and ``report``. They are imported by name where they are used;
importing the package does no work (``portrl parity --help`` reads only ``tolerances``).
"""
