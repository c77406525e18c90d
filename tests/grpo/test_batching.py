import pytest

from minisparse.grpo.batching import equalize_across_ranks, pack_by_tokens, split_steps


def test_first_fit_decreasing():
    # lengths: 0:5 1:4 2:3 3:3 4:2 5:9, budget 8
    # order 9,5,4,3,3,2 -> [5] alone (9 > 8); [0,2] 5+3; [1,3] 4+3; 2 fits [0,2]? 8+2 no;
    # [1,3] 7+2 no -> new bin [4]
    groups = pack_by_tokens([5, 4, 3, 3, 2, 9], 8)
    assert groups == [[5], [0, 2], [1, 3], [4]]


def test_pack_keeps_every_index_once():
    lengths = [7, 1, 1, 6, 2, 2, 5, 3]
    groups = pack_by_tokens(lengths, 8)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(sum(lengths[i] for i in g) <= 8 for g in groups)
    assert len(groups) == 4  # 27 tokens, perfect packing needs ceil(27/8) = 4


def test_split_steps():
    assert split_steps(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError):
        split_steps(5, 2)


def test_equalize_single_process_is_identity():
    assert equalize_across_ranks([[0], [1]]) == [[0], [1]]
