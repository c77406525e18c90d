"""Time the Triton paged decode kernel against the engine's gather + SDPA decode path and
report achieved bandwidth against the bytes that must be read (sum(cache_lens) * H_kv * D *
2 (K and V) * element size), i.e. the fraction of HBM bandwidth the kernel reaches.

    python -m minisparse.bench.decode                    # Qwen2.5-3B layer shapes, bf16
    python -m minisparse.bench.decode --q-heads 28 --kv-heads 4          # 7B
    python -m minisparse.bench.decode --q-heads 32 --kv-heads 8 --head-dim 64  # Llama-1B

Lengths are drawn uniformly within +-10% of each mean. The SDPA column is the engine's
former decode path (gather the slots into a dense copy, then masked SDPA with the G query
heads folded into the query axis). "err" is the kernel's relative error against it.
--fa3 adds FlashAttention-3's paged decode from sgl-kernel (installed with SGLang) on the
same pool: the library alternative to the Triton kernel (measured in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    rows: torch.Tensor
    cache_lens: torch.Tensor
    page_size: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.rows,
                self.cache_lens, self.page_size, self.scale)


def make_case(lens: list[int], h_q: int, h_kv: int, D: int, page_size: int,
              dtype: torch.dtype, device: str = "cpu", seed: int = 0,
              poison: float = float("nan")) -> Case:
    """Sequences of the given cache lengths on shuffled, non-contiguous pages of a pool whose
    every other slot (page tails, spare pages, unused table entries) holds `poison`.
    Built on `device` without per-token host work, so it also makes benchmark-sized pools."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    need = torch.tensor([-(-n // page_size) for n in lens], dtype=torch.long)
    P = max(int(need.max()), 1) + 2  # table wider than any sequence needs
    num_pages = int(need.sum()) + 3  # spare pages stay poisoned
    perm = torch.randperm(num_pages, generator=g)
    R = B + 3
    rows = torch.randperm(R, generator=g)[:B]
    table = torch.full((R, P), int(perm[-1]), dtype=torch.long)  # unused -> a poisoned page
    col = torch.arange(P)
    owned = col[None, :] < need[:, None]  # [B, P]
    sub = table[rows]
    sub[owned] = perm[: int(need.sum())]
    table[rows] = sub
    lens_t = torch.tensor(lens, dtype=torch.long)
    j = torch.arange(max(max(lens), 1))
    valid = j[None, :] < lens_t[:, None]
    slots = (sub[:, (j // page_size).clamp(max=P - 1)] * page_size + j % page_size)[valid]
    dg = torch.Generator(device=device).manual_seed(seed)
    k = torch.full((num_pages * page_size, h_kv, D), poison, dtype=dtype, device=device)
    v = torch.full_like(k, poison)
    slots = slots.to(device)
    k[slots] = torch.randn(len(slots), h_kv, D, generator=dg, device=device).to(dtype)
    v[slots] = torch.randn(len(slots), h_kv, D, generator=dg, device=device).to(dtype)
    q = torch.randn(B, h_q, D, generator=dg, device=device).to(dtype)
    return Case(q, k, v, table.to(device), rows.to(device),
                lens_t.to(device, torch.int32), page_size, D ** -0.5)



def fa3_kernel() -> Callable:
    """sgl-kernel's flash_attn_with_kvcache, or a RuntimeError saying what to install."""
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except ImportError as e:
        raise RuntimeError(f"--fa3 needs sgl-kernel (it comes with SGLang): {e}") from e
    return flash_attn_with_kvcache


def fa3_decode(c: Case, max_len: int) -> Callable[[], torch.Tensor]:
    """A closure running sgl-kernel's FA3 paged decode (flash_attn_with_kvcache) on case c:
    the pool viewed as [pages, page_size, H_kv, D] and each sequence's page-table row as
    int32, gathered once outside the timed call (an engine would do it once per step)."""
    flash_attn_with_kvcache = fa3_kernel()
    B, h_q, D = c.q.shape
    h_kv = c.k_cache.shape[1]
    pages = -(-max_len // c.page_size)
    table = c.page_table[c.rows][:, :pages].to(torch.int32).contiguous()
    k = c.k_cache.view(-1, c.page_size, h_kv, D)
    v = c.v_cache.view(-1, c.page_size, h_kv, D)
    q = c.q.view(B, 1, h_q, D)
    lens = c.cache_lens.to(torch.int32)

    def run() -> torch.Tensor:
        # one query per sequence: causal (aligned to the cache's end) attends to all of it
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table,
                                      softmax_scale=c.scale, causal=True)
        return (out[0] if isinstance(out, tuple) else out).view(B, h_q, D)

    return run


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONFIGS = "256x640,256x4096,64x4096,16x4096,4x16384,1x16384"


def gather_sdpa(c: Case, max_len: int):
    """A closure running the engine's original decode attention on case c: gather each
    sequence's slots (length padded to 16) into [B, H_kv, L, D], fold the G query heads of a
    KV head into SDPA's query axis and mask entries past cache_lens."""
    B, h_q, D = c.q.shape
    h_kv = c.k_cache.shape[1]
    L = -(-max_len // 16) * 16
    j = torch.arange(L, device=c.q.device)
    pages = (j // c.page_size).clamp(max=c.page_table.shape[1] - 1)
    gather = c.page_table[c.rows][:, pages] * c.page_size + j % c.page_size
    mask = (j[None, :] < c.cache_lens[:, None])[:, None, None, :]

    def run() -> torch.Tensor:
        keys = c.k_cache[gather].transpose(1, 2)
        values = c.v_cache[gather].transpose(1, 2)
        qp = c.q.view(B, h_kv, h_q // h_kv, D)
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=c.scale)
        return out.reshape(B, h_q, D)

    return run


def bench_one(B: int, mean: int, args: argparse.Namespace) -> dict:
    from triton.testing import do_bench

    from minisparse.engine.layers import triton_decode  # imported on use: see paged_decode.py
    from minisparse.engine.layers.fused_ops import num_sms

    g = torch.Generator().manual_seed(B * 7919 + mean)
    lo, hi = max(1, int(mean * 0.9)), int(mean * 1.1) + 1
    lens = torch.randint(lo, hi, (B,), generator=g).tolist()
    dtype = DTYPES[args.dtype]
    c = make_case(lens, args.q_heads, args.kv_heads, args.head_dim, args.page_size, dtype,
                  device="cuda", poison=0.0)
    max_len = max(lens)
    run = lambda: triton_decode.paged_decode_attention(*c.args(), max_len=max_len)  # noqa: E731
    ref_fn = gather_sdpa(c, max_len)
    out, ref = run(), ref_fn()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    t_k = do_bench(run, warmup=25, rep=args.rep, return_mode="median")
    t_s = do_bench(ref_fn, warmup=25, rep=args.rep, return_mode="median")
    nbytes = sum(lens) * args.kv_heads * args.head_dim * 2 * c.k_cache.element_size()
    splits = triton_decode.choose_splits(B * args.kv_heads, max_len, num_sms(c.q.device))
    row = dict(B=B, L=mean, splits=splits, ms=t_k, gbs=nbytes / t_k / 1e6, sdpa_ms=t_s,
               sdpa_gbs=nbytes / t_s / 1e6, speedup=t_s / t_k, err=err)
    if args.fa3:
        fa3 = fa3_decode(c, max_len)
        t_f = do_bench(fa3, warmup=25, rep=args.rep, return_mode="median")
        row.update(fa3_ms=t_f, fa3_gbs=nbytes / t_f / 1e6,
                   fa3_err=float((fa3().float() - ref.float()).norm() / ref.float().norm()))
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (also what the GPU tests pass to bench_one)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=CONFIGS, help="comma list of BATCHxMEAN_LENGTH")
    p.add_argument("--q-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--rep", type=int, default=200, help="do_bench time budget per call (ms)")
    p.add_argument("--fa3", action="store_true",
                   help="also time sgl-kernel's FA3 paged decode on the same pool")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.fa3:
        try:
            fa3_kernel()
        except RuntimeError as e:  # before any timing, without a traceback
            raise SystemExit(f"bench_decode: {e}") from e
    print(f"{torch.cuda.get_device_name()}  H_q={args.q_heads} H_kv={args.kv_heads} "
          f"D={args.head_dim} page={args.page_size} {args.dtype}")
    head = f"{'B':>4} {'L':>6} {'splits':>6} {'triton ms':>10} {'GB/s':>7} " \
           f"{'sdpa ms':>9} {'GB/s':>7} {'speedup':>8} {'err':>8}"
    if args.fa3:
        head += f" {'fa3 ms':>9} {'GB/s':>7} {'fa3/triton':>10} {'fa3 err':>8}"
    print(head)
    for cfg in args.configs.split(","):
        B, L = (int(x) for x in cfg.split("x"))
        r = bench_one(B, L, args)
        print(f"{r['B']:>4} {r['L']:>6} {r['splits']:>6} {r['ms']:>10.4f} {r['gbs']:>7.0f} "
              f"{r['sdpa_ms']:>9.4f} {r['sdpa_gbs']:>7.0f} {r['speedup']:>7.2f}x "
              f"{r['err']:>8.1e}" + (f" {r['fa3_ms']:>9.4f} {r['fa3_gbs']:>7.0f} "
                                       f"{r['fa3_ms'] / r['ms']:>9.2f}x {r['fa3_err']:>8.1e}"
                                       if args.fa3 else ""))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
