"""One real-tree rank process: ``python tests/_realtree_rank.py <workdir> <rank> <port>`` (started by
``_glue_ranks.run_real``; PYTHONPATH puts the assembled tree first). See ``_glue_ranks.real_rank_main``."""

import sys
from pathlib import Path

if __name__ == "__main__":
    import _glue_ranks

    _glue_ranks.real_rank_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
