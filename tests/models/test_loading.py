"""load_policy's errors: a model directory that is not there names how to get it."""
import pytest

from minisparse.models.loading import load_policy


def test_missing_download_names_the_command(tmp_path):
    path = tmp_path / "checkpoints" / "smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(path))
    assert str(info.value) == (
        f"model path '{path}' holds no model (no config.json there); download it with: "
        f"python -m minisparse.download --model smollm2-135m-instruct "
        f"--out {tmp_path / 'checkpoints'}/")


def test_other_missing_paths_list_what_else_works(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local HF checkpoint directory .*"
                                                "qwen2.5-3b.*or 'tiny'"):
        load_policy(str(tmp_path / "my-model"))
