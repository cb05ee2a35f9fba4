"""``stepskip.testing.make_rollout_batch``: a size it cannot build is a clear error naming the argument."""

from __future__ import annotations

import pytest

from stepskip.testing import make_rollout_batch


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"response_len": 0}, "response_len = 0"), ({"prompt_len": 0}, "prompt_len = 0"), ({"rows": 0}, "rows = 0"),
    ({"n": 0}, "n = 0"), ({"rows": 2.5}, "rows = 2.5"), ({"min_fill": 0}, "min_fill = 0"),
    ({"min_fill": 1.5}, "min_fill = 1.5"),
])
def test_a_size_it_cannot_build_is_named(kwargs, named):
    args = {"rows": 4, "prompt_len": 4, "response_len": 4, "n": 2, **kwargs}
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        make_rollout_batch(**args)


def test_the_smallest_batch_is_built():
    batch = make_rollout_batch(1, 1, 1, n=1)
    assert batch.batch["input_ids"].shape == (1, 2)
