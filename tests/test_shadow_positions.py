"""``argmax`` over a mask with a value finds positions, not routing choices
(`tpkit.trace.shadow`): Kolibri-1.1's indexers group queries by their first visible key,
``visible.int().argmax(-1)``, and loop over the groups. Made-up round-robin positions gave a
causal mask's queries as many groups as rows (21 loops for 3 x 7 queries instead of 3, in 7
layers, in every shadow run at full size); computed on the mask, the loop runs once per row.
Float scores (a router's logits) keep their round-robin routing, so every expert is reached."""

import torch

from tpkit.compat import FakeTensorMode
from tpkit.trace.shadow import ShadowValues


def test_argmax_of_a_known_mask_is_its_first_true_position():
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mode = ShadowValues(fake)
    with fake, mode:
        rows = torch.arange(7, device="meta")
        visible = rows[:, None] >= rows[None, :]  # a causal mask, made: shadowed
        visible = visible[None].expand(3, 7, 7)
        starts = visible.int().argmax(-1)
        groups = [starts[b].unique().tolist() for b in range(3)]
        last = visible.flip(-1).int().argmin(-1)  # 0/1 integers too: computed
        scores = torch.zeros(3, 7, 5, device="meta") + rows[None, :, None].float()
        picks = scores.argmax(-1)  # float scores: made-up round-robin routing
        known, routed = mode.known(last), mode.known(picks)
    assert groups == [[0], [0], [0]]  # one group per row, as computed unsplit
    assert known is not None and torch.equal(known, torch.zeros(3, 7, dtype=torch.long))
    assert routed is not None and routed.unique().numel() == 5  # every "expert" reached
