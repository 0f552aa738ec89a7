"""``python -m tpkit.cli.main``: the ``tpkit`` command (what ``tpkit run`` relaunches under torchrun)."""

from tpkit.cli.main import entry

__all__: list[str] = []

if __name__ == "__main__":
    entry()
