"""Measurement: one harness for the search's trials, ``dtune bench``, ``dtune profile``, ``dtune verify`` and the
scripts in ``benchmarks/``.

- :mod:`.inputs`: the one input builder and the measured :class:`~.inputs.Workload` (initial state, final
  state, packed sequences);
- :mod:`.timing`: the one timing function (CUDA events, L2 flushed, median; CUDA-graph replay for decode);
- :mod:`.work`: the one FLOP/byte model per kernel family, and the roofline;
- :mod:`.resources`: the one resource capture (registers, spills, shared memory of the launched kernels);
- :mod:`.error`: the one error metric (relative RMS against the float64 reference);
- :mod:`.harness`: :func:`~.harness.op_run`, one measured call (inputs, workload, work) built from the above;
- :mod:`.configs`: which config a measurement runs (a tuned-config file, else the store, else the default);
- :mod:`.grids`: the default shapes of ``dtune bench`` and ``dtune profile``;
- :mod:`.bench`, :mod:`.baselines`, :mod:`.profile`, :mod:`.verify`, :mod:`.first_call`, :mod:`.sm90`,
  :mod:`.tables`: what the commands and the GPU scripts run and write.
"""
