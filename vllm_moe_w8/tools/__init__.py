"""The tools: the ``vllm-moe-w8`` command (``cli``) and its sub-commands: ``plan`` (deployment arithmetic from
a model's config), ``convert`` (repack a checkpoint once, ahead of serving), ``inspect`` (what a checkpoint
holds and whether it is complete) and ``demo`` (serve a tiny model end to end). The tools sit beside the
serving path: they may import the codec and the tiny-model writer, and import vLLM only inside ``demo``'s
server subprocess; nothing in the serving path imports them.
"""
