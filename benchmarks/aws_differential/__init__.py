"""Differential harness: NKI kernels written by AWS, run unmodified in the project's interpreter, against references.

AWS's kernels are the interpreter's acceptance test (issue #31): an interpreter that only agrees with kernels its own
authors wrote proves nothing. This package never contains AWS code. It takes a local folder of AWS's public sources
as an argument, maps only module paths (``nki``, ``nki.language``, ``nki.isa``, ``nki.isa.constants``) onto
``vllm_moe_w8.kernels.nki_cpu`` (:mod:`.loader`), runs each pinned kernel (:mod:`.cases_sdk`, :mod:`.cases_library`;
the same list is in DEVELOPING.md, "AWS kernels as the interpreter's acceptance test") on inputs made here, compares
with a numpy reference written here (:mod:`.references`) and prints per kernel one verdict:

* ``exact``: the output equals the reference within the case's named bound (``bit-exact`` where the arithmetic is
  exact; otherwise a bound derived from the dtypes' rounding, stated per case);
* ``wrong``: it ran and differs beyond that bound;
* ``refused``: the interpreter raised ``NkiValidationError``; the case says whether AWS's docs allow the kernel
  (``refused, legal per docs`` is an interpreter bug, ``refused, illegal per docs`` the rule working);
* ``unsupported``: anything else stopped it (a name the interpreter lacks, an argument it does not take).

Folder layout: ``<folder>/<repo>@<commit[:7]>/<path in the repo>``, e.g.
``aws-neuron-sdk@81ce03a/nki/examples/...``; every case names the repository, the full commit and the path.
Run: ``.venv/bin/python -m benchmarks.aws_differential <folder> [--json out.json] [--only id,...]``.
"""
