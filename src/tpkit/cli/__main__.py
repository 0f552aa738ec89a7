"""``python -m tpkit.cli.main``: the ``tpkit`` command (what ``tpkit run`` relaunches under torchrun)."""

import sys

from tpkit.cli.main import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
