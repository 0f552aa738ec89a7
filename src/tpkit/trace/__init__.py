"""The model run on fake tensors, to see its dataflow. Pure: no process group, meta is fine.

reductions.py  which dims a torch call reads across (reductions, selections, scans)
shadow.py      made-up values for data-dependent routing on fake tensors, memory-bounded
inputs.py      trace inputs made up from the model when none are given
fake.py        a forward on fake tensors (parameters swapped for fake meta ones)
trace.py       one fake forward tagging the dataflow between linear-like modules
"""

__all__: list[str] = []
