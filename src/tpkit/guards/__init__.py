"""Checks installed on a split model: what tensor parallelism silently assumes, tested where it
would otherwise give a wrong number or a hang.

    generation.py  generate()'s inputs moved to this rank's device and checked across the group
    debug.py       the first forwards' inputs and outputs checked across the group
                   (every forward with TPKIT_DEBUG=1); a never-loaded meta model refused
"""

__all__: list[str] = []
