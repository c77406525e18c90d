"""What the engine's Triton kernels compile to on an H100/H200 (sm_90a), on a CPU machine:
registers per thread, spilled bytes, shared memory per program, the shared-memory buffers
of the pipelined loads (how many tiles can be in flight), and from these the programs that
fit on one SM. Triton compiles to PTX and its bundled ptxas assembles it; no GPU needed.

Why: GPU time is scarce and the tiling sweeps only say *that* a variant is slower. This
says why, before a run: e.g. the decode attention kernel single-buffers its K/V tiles at
num_stages 2-4 (the page-id load takes a stage of its own), which is why
triton_decode.pipeline_stages asks for 5 where double buffering pays.

    python scripts/kernel_resources.py                    # decode attention tilings
    python scripts/kernel_resources.py --kernel sampler   # the fused sampler's chunk kernel

Arguments get the specialisation the launcher gives them on the GPU: pointers and the
integer arguments named in `divisible` are marked divisible by 16 (without it Triton
neither vectorises nor pipelines the loads, and the numbers mean nothing).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

SM_REGISTERS, SM_SHARED, SM_PROGRAMS = 65536, 228 * 1024, 32  # per SM on sm_90


@dataclass
class Resources:
    registers: int  # per thread
    spill_bytes: int  # stores, per thread
    shared: int  # bytes per program
    buffers: list[str]  # shape of each multi-buffered shared allocation, e.g. "2x64x128"
    num_warps: int

    @property
    def programs_per_sm(self) -> int:
        by_regs = SM_REGISTERS // max(self.registers * self.num_warps * 32, 1)
        return min(by_regs, SM_SHARED // max(self.shared, 1), SM_PROGRAMS)


def ptxas() -> str:
    import triton.backends.nvidia as nvidia
    return os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")


def compile_sm90(fn, types: dict[str, str], constexprs: dict, divisible: set[str], *,
                 num_warps: int, num_stages: int) -> Resources:
    """fn's resources for sm_90a. types: Triton type of every non-constexpr argument
    ("*bf16", "i32", "fp32", ...); divisible: integer arguments the launcher would see as
    multiples of 16 (pointers always are)."""
    names = fn.arg_names
    missing = [n for n in names if n not in types and n not in constexprs]
    if missing:
        raise ValueError(f"no type or constexpr value for {missing}")
    sig = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in constexprs and (types[n].startswith("*") or n in divisible)}
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", path, "-o",
                                 os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    buffers = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+(?:x\d+)+)x", kernel.asm["ttgir"])
    return Resources(int(regs.group(1)) if regs else 0, int(spill.group(1)) if spill else 0,
                     kernel.metadata.shared, buffers, num_warps)


def decode_attention(block_n: int, num_warps: int, num_stages: int, *, rope: bool = True,
                     splits: int = 1, q_heads: int = 16, kv_heads: int = 2,
                     head_dim: int = 128, page_size: int = 16) -> Resources:
    """triton_decode's kernel at the engine's decode-step call (bf16, Qwen2.5-3B heads)."""
    from minisparse.engine.layers import triton_decode as td

    typed = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "MID_O": "*fp32",
             "MID_LSE": "*fp32", "PT": "*i64", "ROWS": "*i64", "LENS": "*i32",
             "COUNT": "*i32", "COS": "*bf16", "SIN": "*bf16", "SLOTS": "*i64", "RING": "*bf16",
             "RING_ROWS": "*i64", "qk_scale": "fp32"}
    types = {n: typed.get(n, "i32") for n in td._split_kernel.arg_names}
    const = dict(td.shape_constants(q_heads, kv_heads, head_dim, page_size, block_n, splits),
                 IEEE=False, ROPE=rope, HAS_RING=False)
    divisible = {"stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh",
                 "stride_ob", "stride_oh", "split_len", "stride_mb", "stride_mh"}
    return compile_sm90(td._split_kernel, types, const, divisible, num_warps=num_warps,
                        num_stages=num_stages)


def sampler(block: int, num_warps: int, *, greedy: bool = False, chunks: int = 19) -> Resources:
    """sampler_triton's chunk kernel (bf16 logits, no truncation, as in the bench)."""
    from minisparse.engine.layers import sampler_triton as st

    typed = {"LOGITS": "*bf16", "COL_HASH": "*i32", "SEEDS": "*i64", "STEPS": "*i64",
             "THRESH": "*fp32", "M_OUT": "*fp32", "L_OUT": "*fp32", "K_OUT": "*fp32",
             "I_OUT": "*i32", "S_OUT": "*fp32", "inv_t": "fp32"}
    types = {n: typed.get(n, "i32") for n in st._partial_kernel.arg_names}
    const = dict(NSPLIT=chunks, GREEDY=greedy, HAS_THRESH=False, BLOCK=block, FAST=True)
    return compile_sm90(st._partial_kernel, types, const, {"stride_row", "chunk"},
                        num_warps=num_warps, num_stages=1)


def _row(label: str, r: Resources) -> str:
    return (f"| {label} | {r.registers} | {r.spill_bytes} | {r.shared // 1024} KB | "
            f"{', '.join(r.buffers) or '-'} | {r.programs_per_sm} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=["decode", "sampler"], default="decode")
    args = p.parse_args()
    print("| config | registers | spill bytes | shared | buffers | programs / SM |")
    print("|---|---|---|---|---|---|")
    if args.kernel == "decode":
        for splits in (1, 4):
            for block_n, warps, stages in [(64, 4, 2), (64, 4, 4), (64, 4, 5), (32, 4, 2),
                                           (32, 4, 5), (128, 4, 2)]:
                r = decode_attention(block_n, warps, stages, splits=splits)
                print(_row(f"splits {splits}, block_n {block_n}, {warps} warps, {stages} stages",
                           r), flush=True)
    else:
        for greedy in (False, True):
            for block, warps in [(1024, 4), (512, 4), (2048, 8)]:
                print(_row(f"{'greedy' if greedy else 'sampled'}, block {block}, {warps} warps",
                           sampler(block, warps, greedy=greedy)), flush=True)


if __name__ == "__main__":
    main()
