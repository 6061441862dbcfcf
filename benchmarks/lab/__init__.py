"""The measurement lab: what every benchmark of ``benchmarks/`` builds on, so that no benchmark imports another.

- :mod:`lab.methods`: method names (``low_rank_r4``, ``diloco_h20``, ``torchft_diloco_h20``) and what they run.
- :mod:`lab.models`: the tasks' networks and the language model of the GPU lab.
- :mod:`lab.harness`: the round order, ports, local process groups, NCCL over sockets, network namespaces and
  ``tc`` links with their check, worker output.
- :mod:`lab.results`: one results schema (benchmark, command, date, machine, versions, settings, peers, rows), the
  machine record, the spread of repeated figures.
- :mod:`lab.tasks`: the convergence tasks' settings and data sets, the methods they train and their baselines.
- :mod:`lab.torchft_peer`: torchft's DiLoCo as a peer of the engine's ``diloco`` (torchft in an environment of
  its own).
- :mod:`lab.render`: markdown tables and charts, which the documentation imports instead of rendering again.
- :mod:`lab.traffic`: the bytes each algorithm sends per step, by its definition; the targets check and the
  documentation's tables both evaluate it.
- :mod:`lab.gpu_report`: the GPU step-time lab's results read and merged, for its report, the README and the docs.

The benchmarks are scripts: each runs with ``benchmarks/`` as its folder on ``sys.path`` and imports ``lab.*``.
"""
