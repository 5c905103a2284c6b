"""STUB (real-tree mode, tests only): stands for ``vllm_neuron/vllm/worker/neuron_model_runner.py`` (upstream
@9fc042ea: the runner; it imports the whole Neuron runtime). neuron-w8 only tests that the module exists (its
generation test, ``interfaces.generation``); the runner's ``load_model`` sequence is reproduced by the test harness
(``tests/_realtree.py``, ``load_like_runner``), citing the same file."""
