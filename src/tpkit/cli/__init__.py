"""The ``tpkit`` command and the launcher: outer rooms, which the core never imports.

main.py    ``tpkit plan`` (on meta, no process group), ``tpkit run``, ``tpkit export``, ...
cli/launch.py  ``tpkit.launch(fn)`` and ``tpkit run``: ranks started through torchrun
"""

__all__: list[str] = []
