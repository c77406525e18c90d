import pytest

from minisparse.trainer.batching import (equalize_across_ranks, pack_by_tokens, split_steps,
                                      step_micro_batches)


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


def test_step_micro_batches_pack_each_step_apart():
    # step 0: samples 0-3 (5, 4, 3, 3) -> [0, 2] 5+3, [1, 3] 4+3
    # step 1: samples 4-7 (2, 9, 1, 7) -> 9 alone, [6, 7] 1+7, [4] 2
    lengths = [5, 4, 3, 3, 2, 9, 1, 7]
    assert step_micro_batches(lengths, 2, 8) == [[[0, 2], [1, 3]], [[5], [6, 7], [4]]]
    assert step_micro_batches(lengths, 1, 8) == [pack_by_tokens(lengths, 8)]
    with pytest.raises(ValueError):
        step_micro_batches(lengths, 3, 8)


def test_equalize_single_process_is_identity():
    assert equalize_across_ranks([[0], [1]]) == [[0], [1]]
