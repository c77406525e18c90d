"""The conversion's parallel load (minisparse/models/gguf_load.py) against transformers'
own GGUF path, file by file and tensor by tensor: on test_gguf.py's tiny llama GGUF (q/k
rows in llama.cpp's order, a tied embedding: whole tensors, reordered in the workers), on
a tiny qwen2 one (biases, an output layer apart from the embedding, nothing reordered:
tensors split into blocks of rows), and on the real Qwen2.5-Coder-0.5B where it is."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf import (CHATML, EPS, HEADS, HIDDEN, KV_HEADS, LAYERS, SPECIALS,
                       byte_alphabet, tiny_llama, write_gguf)

from minisparse.models import gguf as gguf_model
from minisparse.models import gguf_load

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
REAL = Path(os.environ.get("MINISPARSE_GGUF05", REPO / "checkpoints" /
                           "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
FFN = 128


def qwen2_tensors(vocab: int) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF name -> (float32 values, how the file stores them), seeded."""
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    kv = HIDDEN // HEADS * KV_HEADS
    tensors = {"token_embd.weight": (w(vocab, HIDDEN), "Q8_0"),
               "output.weight": (w(vocab, HIDDEN), "Q8_0"),
               "output_norm.weight": (1 + w(HIDDEN), "F32")}
    for i in range(LAYERS):
        tensors.update({f"blk.{i}.{name}": value for name, value in {
            "attn_norm.weight": (1 + w(HIDDEN), "F32"), "ffn_norm.weight": (1 + w(HIDDEN), "F32"),
            "attn_q.weight": (w(HIDDEN, HIDDEN), "F32"), "attn_q.bias": (w(HIDDEN), "F32"),
            "attn_k.weight": (w(kv, HIDDEN), "F16"), "attn_k.bias": (w(kv), "F32"),
            "attn_v.weight": (w(kv, HIDDEN), "Q5_0"), "attn_v.bias": (w(kv), "F32"),
            "attn_output.weight": (w(HIDDEN, HIDDEN), "Q8_0"),
            "ffn_gate.weight": (w(FFN, HIDDEN), "Q4_0"), "ffn_up.weight": (w(FFN, HIDDEN), "Q4_0"),
            "ffn_down.weight": (w(HIDDEN, FFN), "Q8_0")}.items()})
    return tensors


def write_qwen2_gguf(path: Path) -> None:
    """A tiny qwen2 GGUF in the Qwen2.5-Coder files' layout (their untied output layer,
    several quantizations); llama.cpp keeps qwen2's q/k rows as they are."""
    tokens = SPECIALS + byte_alphabet() + ["Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, FFN), (writer.add_head_count, HEADS),
                       (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, EPS),
                       (writer.add_file_type, gguf.LlamaFileType.MOSTLY_Q8_0),
                       (writer.add_name, "Tiny Qwen2"), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_tokenizer_pre, "qwen2"), (writer.add_token_list, tokens),
                       (writer.add_token_types,
                        [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))),
                       (writer.add_token_merges, ["Ġ t", "h e"]), (writer.add_bos_token_id, 0),
                       (writer.add_eos_token_id, 2), (writer.add_pad_token_id, 0),
                       (writer.add_chat_template, CHATML)]:
        add(value)
    for name, (values, kind) in qwen2_tensors(len(tokens)).items():
        if kind == "F32":
            writer.add_tensor(name, values)
        elif kind == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "Tiny.Q8_0.gguf"
    write_gguf(tiny_llama(), path)
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2") / "Tiny-Qwen2.gguf"
    write_qwen2_gguf(path)
    return path


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so the tiny tensors are split as the real ones are."""
    monkeypatch.setattr(gguf_load, "CHUNK_BYTES", 4096)


def by_transformers(path: Path, out: Path, monkeypatch) -> Path:
    """The folder transformers' own path writes (the one taken for MoE processors)."""
    with monkeypatch.context() as patch:
        patch.setattr(gguf_load, "_processor", lambda architecture: (None, True))
        return gguf_model.convert_gguf(path, out, workers=1)


def assert_same_folder(ours: Path, theirs: Path) -> None:
    """The same tensors (names, order, dtypes, bits) and the same other files."""
    from safetensors.torch import load_file

    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert list(a) == list(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_pool_writes_what_transformers_writes(arch, llama, qwen2, small_blocks, tmp_path,
                                                  monkeypatch):
    """Three workers, blocks of rows for qwen2, llama's q/k reordering in the workers: the
    folder of transformers' one-core path, bit for bit."""
    path = llama if arch == "llama" else qwen2
    reader = gguf.GGUFReader(path)
    kind, reorders = gguf_load._processor(arch)
    jobs = gguf_load._jobs(reader, path, kind() if reorders else None, "bfloat16")
    assert (len(jobs) > len(reader.tensors)) == (arch == "qwen2")
    ours = gguf_model.convert_gguf(path, tmp_path / "ours", workers=3)
    assert_same_folder(ours, by_transformers(path, tmp_path / "theirs", monkeypatch))


def test_blocks_land_by_their_rows_in_any_order(qwen2, small_blocks, tmp_path, monkeypatch):
    """The jobs done last block first (here in this process): the same folder."""
    real = gguf_load._jobs
    monkeypatch.setattr(gguf_load, "_jobs", lambda *args: real(*args)[::-1])
    ours = gguf_model.convert_gguf(qwen2, tmp_path / "ours", workers=1)
    assert_same_folder(ours, by_transformers(qwen2, tmp_path / "theirs", monkeypatch))


def test_the_metadata_is_parsed_once(qwen2, monkeypatch):
    """transformers' config and tokenizer calls share one parse of the metadata; the
    tensor table is the other reader (the conversion built five before: four in
    transformers' calls, one for the eos and pad ids)."""
    made = []
    real = gguf.GGUFReader

    def counted(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    model, tokenizer, _ = gguf_load.load_gguf(qwen2, workers=1)
    assert len(made) == 2
    assert len(tokenizer) == len(SPECIALS) + 256 + 2 and model.config.num_hidden_layers == LAYERS


def test_a_tensor_missing_from_the_file_is_an_error(qwen2, monkeypatch):
    real = gguf_load._jobs
    monkeypatch.setattr(gguf_load, "_jobs", lambda *args: [
        job for job in real(*args) if job.name != "blk.1.attn_v.bias"])
    with pytest.raises(gguf_model.ModelDownloadError,
                       match="no tensor in the file for the model's "
                             "model.layers.1.self_attn.v_proj.bias$"):
        gguf_load.load_gguf(qwen2, workers=1)


def test_only_per_tensor_processors_take_the_pool():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

    assert gguf_load._processor("qwen2") == (TensorProcessor, False)
    assert gguf_load._processor("llama") == (LlamaTensorProcessor, True)
    assert gguf_load._processor("qwen2moe") == (None, True)


def test_workers(qwen2, monkeypatch):
    """MINISPARSE_GGUF_WORKERS, else one for a small file and 16 for another; no more
    than the cores."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(gguf_load.WORKERS_ENV, raising=False)
    assert gguf_load.gguf_workers(qwen2) == 1
    monkeypatch.setenv(gguf_load.WORKERS_ENV, "2")
    assert gguf_load.gguf_workers(qwen2) == min(cores, 2)
    monkeypatch.setenv(gguf_load.WORKERS_ENV, "1000")
    assert gguf_load.gguf_workers(qwen2) == cores
    monkeypatch.delenv(gguf_load.WORKERS_ENV)
    monkeypatch.setattr(gguf_load, "SMALL_GGUF_BYTES", 0)
    assert gguf_load.gguf_workers(qwen2) == min(cores, 16)
    for bad in ("0", "two"):
        monkeypatch.setenv(gguf_load.WORKERS_ENV, bad)
        with pytest.raises(gguf_model.ModelDownloadError, match=f"GGUF_WORKERS={bad}: not a"):
            gguf_load.gguf_workers(qwen2)


@pytest.mark.skipif(not REAL.is_file(), reason=f"no {REAL} (MINISPARSE_GGUF05 names it)")
def test_the_real_coder_05b_is_transformers_own_tensors(tmp_path):
    """Every tensor of the real file (Q4_K, Q5_0, Q6_K, Q8_0, F32; the embedding and
    output split by rows) as transformers' own loader gives it, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_file(gguf_model.convert_gguf(REAL, tmp_path / "coder", workers=2)
                     / "model.safetensors")
    with torch.device("meta"):  # as from_pretrained maps the names
        dummy = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(REAL.parent), gguf_file=REAL.name))
    theirs = load_gguf_checkpoint(str(REAL), return_tensors=True, model_to_load=dummy,
                                  torch_dtype=torch.bfloat16)["tensors"]
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
