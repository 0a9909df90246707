"""The private core: what every other part of dclens stands on.

binding (the BLAS library, then dclens._engine: the only importer of the
compiled module), checks (argument checks and the error classes), names
(hook names), mask, runner (one loaded engine model: every call on it, under
its lock), hooks, tapes, memplan (the memory plan of a pass), batch, weights,
hub, bundled (the models shipped with the package), reference (what names a
model for another process), blas, progress, plugins, help and warning_types
(every warning class). Nothing here imports Model or an analysis
(tests/api/test_imports.py)."""
