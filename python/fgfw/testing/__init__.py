"""What fgfw's tests and benchmarks share, as torch keeps its own in ``torch.testing._internal``: not part of the
optimizers' API, and free to change with the tests.

* :mod:`fgfw.testing.problems`: convex problems with certified optima, built on the device they are asked for.
  It imports only the constraint sets (fgfw.constraints), so a test of any layer can use it.
* :mod:`fgfw.testing.convex`: the optimizers run on one of them (f - f* per step).
"""
