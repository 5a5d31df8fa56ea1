"""Every launch path of pipegoose's own kernels at small sizes, to run under compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 99 python tools/sanitize_kernels.py norms
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py softmax long
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py adam
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py clip
    compute-sanitizer --tool racecheck --error-exitcode 99 python tools/sanitize_kernels.py clip
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py swiglu
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py cross_entropy
    compute-sanitizer --tool racecheck --error-exitcode 99 python tools/sanitize_kernels.py cross_entropy
    compute-sanitizer --tool memcheck  --error-exitcode 99 python tools/sanitize_kernels.py rope
    PIPEGOOSE_NORM_CLUSTERS=0 compute-sanitizer --tool memcheck --error-exitcode 99 python tools/sanitize_kernels.py norms

(the last: the backward plans of a GPU before sm_90, on one that has clusters)

Calls the forward and backward of ``pipegoose/layer_norm`` and ``pipegoose/rms_norm`` (the launch plans of
``norm_kernels.cuh``: scalar rows, register and shared-memory accumulator plans, the asynchronous-copy backward over
many rows, the prefetching and full-grid forward plans, the rows of one block per SM (parameters staged through shared
memory; 32000 and 64000 columns leave their last stride partial), the wide rows' forward (fp32 64000 and 65536 columns:
the first 32768 values of a row in registers, the rest in shared memory, LayerNorm's on a grid of one block per SM that
walks 300 rows; 65544: the two-read kernel), the specialised backward sizes, the wide rows' backward (a thread block
cluster per row on sm_90 and newer, the two-kernel path with fp32 grad_output of a 16-bit input and before sm_90), with
and without parameters, with a weight or a bias alone and with frozen ones (``weight_grad`` / ``bias_grad`` false: both,
either; ``LN_PARAM_CASES``, ``RMS_PARAM_CASES``), fp32 parameters and fp32 grad_output with a 16-bit input) and of
``pipegoose/softmax`` (plain, padding-masked, causal; 1 to 40000 keys; one and three query rows, and whole causal
matrices of 36 to 2056 keys: the row pairs of the forward and the backward) and ``pipegoose/multi_tensor_adam`` (one
step, AdamW and L2, over tensors of 1 to 12289 elements (around both chunk sizes), more than one launch holds, empty
ones, and views at odd offsets: the scalar path) and ``pipegoose/clip_grad_norm`` (the 1, 2 and inf norms and the
multiplication, by 0.5 and by 1, over the same kind of lists: 1 to 3 * 65536 + 5 elements, 1030 tensors (two launches
of 1024), empty ones, views at odd offsets) and ``pipegoose/swiglu`` (forward and backward of 1 to 300007
elements: whole vectors, tails, several blocks; views at odd offsets: the scalar path; geglu's and gelu's, tanh and
erf, and squared_relu's over the same; silu_and_mul's forward and backward, and gelu_and_mul's (tanh and erf), over
``SILU_AND_MUL_CASES``: d of 1 to 28673 values, the vector and the scalar kernel, rows of a wider tensor from an
aligned and a misaligned column, rows of an odd stride, many rows (66050 blocks), and x and grad_output expanded from
one row (row stride 0)) and ``pipegoose/cross_entropy``
(forward and backward over 1 to 151936 classes, the backward's long rows split over 2 to 8 blocks, rows at a stride
that misaligns every other row, ignored and out-of-range targets, the reduced forward's mean and sum, and the
backward's grad_loss at stride 0) and ``pipegoose/rope`` (forward and backward of q
and k from one head and position of 2 elements to 40 + 7 heads of 128 over 300 positions and a Llama-like 32 + 8
heads of 128 over 1024 positions, tables of one batch and of B, no query or no key heads; the vector path, head dims
no multiple of the vector, views at odd offsets, rows of D + 1 elements and a narrowed head dim (the scalar path),
Llama's transposed projections and a fused qkv projection's heads) in fp32, fp16 and bf16, at sizes small enough for
the sanitizers (seconds, not hours).
The optional argument ``norms``, ``softmax``, ``adam``, ``clip``, ``swiglu``, ``cross_entropy`` or ``rope`` limits it to
one family;
``norms`` followed by hidden sizes (of the list ``NORM_HIDDEN``) to those sizes, e.g. ``norms 16384 20000 32768 64000``
for the wide rows' backward; ``softmax long`` adds the 16-bit causal forward of 16387 queries of 16384 keys (the staged
kernel on rows of every length), a square causal matrix of 8200 keys (8196 in fp32: the backward's row pairs with
early zeros) and padding masks broadcast over heads larger than half the L2 (the forward's heads-innermost order); for
memcheck: minutes under racecheck. The GPU tests check values; this checks memory accesses, shared
memory races and initialisation: the test suite itself is too large to run under the sanitizers (out of memory).
"""

from __future__ import annotations

import sys

import torch

NORM_HIDDEN = (1, 7, 32, 64, 96, 100, 128, 200, 264, 448, 576, 768, 896, 960, 1000, 1024, 1152, 1160, 1280, 1536,
               1600, 2048, 2304, 2312, 2560, 3000, 3072, 3584, 3840, 4096, 4608, 5120, 6144, 6400, 7168, 8192, 9224,
               10240, 11264, 12288, 16384, 20000, 32000, 32768, 40008, 64000, 65536, 65544)
# The widths run over 5000 rows as well (see main): every width of BwdSpecExtra in norm_kernels.cuh among them
# (tests/kernels/test_norm_spec_lists.py checks it)
NORM_MANY_ROWS = (200, 264, 576, 768, 896, 960, 1000, 1152, 1160, 1280, 1536, 1600, 2304, 2312, 2560, 3000, 3072,
                  3584, 3840, 4096, 4608, 5120, 6144, 7168)
SOFTMAX_KEYS = (1, 5, 127, 1000, 2048, 4097, 16384, 32768, 40000)
# The parameters of the norms' calls on 3 rows (more rows: weight and bias, both gradients). LayerNorm: (weight given,
# bias given, weight_grad, bias_grad): both, none, each alone, and frozen parameters (a *_grad flag false: that gradient
# is not computed), both or one of the two, and each alone frozen; a flag of an absent parameter says nothing, so it is
# left true there. RMSNorm: (weight given, weight_grad). (A review: the frozen cases were never launched.)
LN_PARAM_CASES = ((True, True, True, True), (False, False, True, True), (False, True, True, True),
                  (True, False, True, True), (True, True, False, False), (True, True, False, True),
                  (True, True, True, False), (True, False, False, True), (False, True, True, False))
RMS_PARAM_CASES = ((True, True), (False, True), (True, False))
# silu_and_mul's calls (rows, d, column offset, extra columns): x [rows, 2d] in rows of offset + 2d + extra values from
# column ``offset`` (0, 0: contiguous). One row of one value a half; odd d (the scalar kernel); one vector a half (8);
# rows of d = 1000 (vectors) and 1001 (scalar); a Llama-2-70B MLP row (28672: a row over several blocks) and an odd one;
# rows of a wider tensor from column 3 (misaligned: scalar) and 8 (aligned, strided: vectors); rows of 2d + 1 values
# (an odd row stride: scalar); 131075 rows of 129 values (the scalar kernel over 66050 blocks, the last one partial;
# tests/kernels/test_norm_spec_lists.py checks that the cases reach these paths).
SILU_AND_MUL_CASES = ((1, 1, 0, 0), (3, 7, 0, 0), (5, 8, 0, 0), (37, 1000, 0, 0), (37, 1001, 0, 0), (3, 28672, 0, 0),
                      (2, 28673, 0, 0), (37, 1000, 3, 5), (37, 1000, 8, 8), (37, 1000, 0, 1), (131075, 129, 0, 0))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    hidden = NORM_HIDDEN
    if which == "norms" and len(sys.argv) > 2:
        try:
            hidden = tuple(int(a) for a in sys.argv[2:])
        except ValueError:
            raise SystemExit(f"sanitize_kernels: norms: expected hidden sizes (integers), got "
                             f"{' '.join(sys.argv[2:])!r}") from None
        if not set(hidden) <= set(NORM_HIDDEN):
            raise SystemExit(f"sanitize_kernels: norms: expected hidden sizes among {NORM_HIDDEN}, got "
                             f"{' '.join(sys.argv[2:])!r}")
    elif which not in ("all", "norms", "softmax", "adam", "clip", "swiglu", "cross_entropy", "rope") or \
            sys.argv[2:] not in ([], ["long"] if which == "softmax" else []):
        raise SystemExit(f"sanitize_kernels: expected 'norms' [HIDDEN ...], 'softmax' [long], 'adam', 'clip', "
                         f"'swiglu', 'cross_entropy', 'rope' or nothing, got "
                         f"{' '.join(sys.argv[1:])!r}")
    long_rows = sys.argv[2:] == ["long"]
    if not torch.cuda.is_available():
        raise SystemExit("sanitize_kernels: needs a CUDA GPU")
    from pipegoose.kernels import load
    calls = 0
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    if which in ("all", "norms"):
        ln, rms = load("pipegoose/layer_norm"), load("pipegoose/rms_norm")
        for dt in dtypes:
            for h in hidden:
                # 5000 rows: each row group of the persistent backward walks several rows (the asynchronous-copy
                # kernel's ring of stages wraps around; in 16-bit, 200 and 264 run the kernel of run-time geometry
                # (three stages), 1000 kernels compiled for their threads per row, 2312 one packing three rows to a
                # block of 512 threads, 1160 ten rows (LayerNorm) to a block of 1024, 768 and 4096 kernels compiled
                # for the size, packed into blocks of 512, and 576-7168 kernels compiled for the size where
                # BwdSpecExtra lists them (else those compiled for their threads per row), packed into blocks of 512
                # or 1024 (5120: three rows); in fp32, 1160 and 3000 LayerNorm rows packed into blocks of 1024, and
                # the fp32 kernels compiled for the size (BwdSpecExtra; LayerNorm 4608 and 6144 and RMSNorm 7168 on
                # norm_bwd_kernel's shared-memory plan)).
                # 601 rows of 20000 columns: the clusters of the wide rows' backward (16-bit: 3 blocks, the last slab
                # shorter; fp32: 4) walk several steps and their rings of stages wrap around, with a last step of one
                # row in two (40008 columns, 16-bit clusters of 5 blocks: 3 rows; with 601 rows, memcheck ran clean
                # in session 37, but racecheck of 20000 and 40008 columns did not end within 150 s, where with 3 it
                # ended in under 60). 601 rows of 9224 and 11264 columns: 16-bit RMSNorm's rows on sm_90's cluster
                # kernel (2 blocks), and where no cluster runs (PIPEGOOSE_NORM_CLUSTERS=0, before sm_90) its wide
                # register rows (one 768-thread block per SM, four stages): their stages wrap.
                many = h in NORM_MANY_ROWS
                # 300 fp32 rows of 64000 and 65536 columns: LayerNorm's split forward walks rows, a block per SM,
                # each block copying its next row into the shared memory that its current row's output has read
                walk = h in (64000, 65536) and dt == torch.float32
                wrap = h in (9224, 11264)
                for rows in ((3, 37, 5000) if many else (3, 37, 601) if h == 20000 else (3, 601) if wrap
                             else (3, 300) if walk else (3,)):
                    for pdt in ({dt, torch.float32} if h in (1000, 4096, 12288) else {dt}):
                        x = torch.randn(rows, h, device="cuda", dtype=dt)
                        dy = torch.randn_like(x)
                        w = torch.randn(h, device="cuda", dtype=pdt)
                        b = torch.randn(h, device="cuda", dtype=pdt)
                        few = rows == 3
                        for has_w, has_b, w_grad, b_grad in LN_PARAM_CASES if few else ((True, True, True, True),):
                            ww, bb = w if has_w else None, b if has_b else None
                            _, mean, rstd = ln.layer_norm_forward(x, ww, bb, 1e-5, None)
                            ln.layer_norm_backward(dy, x, ww, bb, mean, rstd, w_grad, b_grad)
                            calls += 2
                        for has_w, w_grad in RMS_PARAM_CASES if few else ((True, True),):   # (no bias)
                            ww = w if has_w else None
                            _, r = rms.rms_norm_forward(x, ww, 1e-5, None)
                            rms.rms_norm_backward(dy, x, ww, r, w_grad)
                            calls += 2
                        if dt != torch.float32 and rows != 5000:
                            # fp32 grad_output with a 16-bit input (autocast): the plans of norm_bwd_kernel that the
                            # asynchronous-copy kernel does not take
                            _, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5, torch.float32)
                            ln.layer_norm_backward(dy.float(), x, w, b, mean, rstd)
                            _, r = rms.rms_norm_forward(x, w, 1e-5, torch.float32)
                            rms.rms_norm_backward(dy.float(), x, w, r)
                            calls += 4
    if which in ("all", "softmax"):
        sm = load("pipegoose/softmax")
        for dt in dtypes:
            for sk in SOFTMAX_KEYS:
                # 37 query rows: row counts that leave the forward's multi-row blocks (several rows per thread
                # at up to 32 vectors per row) partly filled
                for sq in (1, 3, 37) if sk <= 1000 else (1, 3):
                    x = torch.randn(2, 2, sq, sk, device="cuda", dtype=dt)
                    mask = torch.rand(2, 1, sq, sk, device="cuda") < 0.3
                    for m, causal in ((None, False), (mask, False), (None, sq <= sk), (mask, sq <= sk)):
                        y = sm.softmax_forward(x, m, 0.5, causal)
                        sm.softmax_backward(torch.randn_like(y), y, 0.5, causal)
                        calls += 2
            # whole causal matrices (sq == sk: the row pairs of the 16-bit forward from 1025 keys and of the backward
            # at the lengths softmax.cuh's causal_pair_bwd_plan takes): every row length from 1 to sk, an odd and an
            # even number of vectors per row (36 and 132: odd in fp32), two heads
            for sk in (36, 40, 132, 136, 1000, 1032, 2056):
                x = torch.randn(1, 2, sk, sk, device="cuda", dtype=dt)
                y = sm.softmax_forward(x, None, 0.5, True)
                sm.softmax_backward(torch.randn_like(y), y, 0.5, True)
                calls += 2
            if long_rows and dt != torch.float32:
                # the 16-bit forward's staged kernel (rows of kCausalSmemMin keys and more) on rows of every length:
                # 16387 queries of 16384 keys (the first three see none), one row of scores repeated (a stride-0
                # view). Hundreds of millions of shared memory accesses: for memcheck (racecheck takes long here,
                # and the grid runs one row per block, so no block reuses its shared memory for a second row)
                x = torch.randn(1, 1, 1, 16384, device="cuda", dtype=dt).expand(1, 1, 16387, 16384)
                sm.softmax_forward(x, None, 0.5, True)
                calls += 1
            if long_rows:
                # the backward's row pairs with the zeros stored early (the plan that holds 16384 keys) on a square
                # causal matrix of an odd number of vectors: 8200 keys in 16-bit, 8196 in fp32
                sk = 8196 if dt == torch.float32 else 8200
                y = sm.softmax_forward(torch.randn(1, 1, sk, sk, device="cuda", dtype=dt), None, 0.5, True)
                sm.softmax_backward(torch.randn_like(y), y, 0.5, True)
                calls += 2
                # a padding mask broadcast over heads larger than half the L2: the forward walks the heads innermost
                # (softmax.cuh heads_inner_takes), in the register-resident kernel (4096 and 4099 keys) and the
                # two-pass one (40000)
                l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
                for sk in (4096, 4099, 40000):
                    sq = (l2 // (3 * sk * (torch.finfo(dt).bits // 8)) + 1) | 1
                    mask = torch.rand(2, 1, sq, sk, device="cuda") < 0.3
                    for causal in (False, True):
                        sm.softmax_forward(torch.randn(2, 3, sq, sk, device="cuda", dtype=dt), mask, 0.5, causal)
                        calls += 1
    if which in ("all", "adam"):
        adam = load("pipegoose/multi_tensor_adam")
        # sizes around the chunks (2048 16-bit, 4096 fp32 elements) and the vector width; 393 tensors: two launches
        # (384 a launch)
        sizes = [1, 3, 2047, 2049, 4095, 4096, 4097, 12289, 0] + [5] * 383 + [0] + [2048]
        for dt in dtypes:
            lists = [[torch.randn(n, device="cuda", dtype=dt) for n in sizes] for _ in range(3)]
            lists.append([torch.rand(n, device="cuda", dtype=dt) for n in sizes])
            for k in range(3):   # misaligned views (offset 1 of a larger buffer) in one list each
                lists[k][k + 1] = torch.randn(sizes[k + 1] + 1, device="cuda", dtype=dt)[1:]
            for adam_w_mode in (True, False):
                adam.adam_step(*lists, 1e-3, 0.9, 0.999, 1e-8, 3, adam_w_mode, True, 0.01)
                calls += 1
    if which in ("all", "clip"):
        clip = load("pipegoose/clip_grad_norm")
        # around the chunks (4096 fp32, 8192 16-bit elements) and the vector width; 1030 tensors: two launches
        sizes = [1, 3, 4095, 4097, 8191, 8193, 3 * 65536 + 5, 0] + [5] * 1020 + [0] + [4096]
        for dt in dtypes:
            ts = [torch.randn(n, device="cuda", dtype=dt) for n in sizes]
            ts[1], ts[4] = (torch.randn(sizes[k] + 1, device="cuda", dtype=dt)[1:] for k in (1, 4))   # misaligned
            for norm_type in (2.0, 1.0, float("inf")):
                clip.multi_tensor_norm(ts, norm_type)
                calls += 1
            for coef in (0.5, 1.0):
                clip.multi_tensor_mul_(ts, torch.tensor(coef, device="cuda"))
                calls += 1
    if which in ("all", "swiglu"):
        sw = load("pipegoose/swiglu")
        for dt in dtypes:
            for n in (1, 7, 8, 9, 4095, 4096 * 2 + 5, 300007):
                g, u, dy = (torch.randn(n, device="cuda", dtype=dt) for _ in range(3))
                sw.swiglu_forward(g, u)
                sw.swiglu_backward(dy, g, u)
                # views at element offset 1 (not 16-byte aligned): the scalar path
                g1, u1, dy1 = (torch.randn(n + 1, device="cuda", dtype=dt)[1:] for _ in range(3))
                sw.swiglu_forward(g1, u1)
                sw.swiglu_backward(dy1, g1, u1)
                calls += 4
                # geglu: the same launch with GELU (tanh and erf), aligned and at offset 1; and that launch with one
                # input: gelu (tanh and erf) and squared_relu
                for approximate in ("tanh", "none"):
                    for a, b, c in ((g, u, dy), (g1, u1, dy1)):
                        sw.geglu_forward(a, b, approximate)
                        sw.geglu_backward(c, a, b, approximate)
                        sw.gelu_forward(a, approximate)
                        sw.gelu_backward(c, a, approximate)
                        calls += 4
                for a, c in ((g, dy), (g1, dy1)):
                    sw.squared_relu_forward(a)
                    sw.squared_relu_backward(c, a)
                    calls += 2
            for rows, d, offset, extra in SILU_AND_MUL_CASES:
                x = torch.randn(rows, offset + 2 * d + extra, device="cuda", dtype=dt)[:, offset:offset + 2 * d]
                dy = torch.randn(rows, d, device="cuda", dtype=dt)
                sw.silu_and_mul_forward(x)
                sw.silu_and_mul_backward(dy, x)
                calls += 2
                # gelu_and_mul: the same launch with GELU (tanh and erf)
                for approximate in ("tanh", "none"):
                    sw.gelu_and_mul_forward(x, approximate)
                    sw.gelu_and_mul_backward(dy, x, approximate)
                    calls += 2
            # x and grad_output of one row expanded over 37 (row stride 0: read in place, vectors)
            x = torch.randn(1, 2000, device="cuda", dtype=dt).expand(37, 2000)
            dy = torch.randn(1, 1000, device="cuda", dtype=dt).expand(37, 1000)
            sw.silu_and_mul_forward(x)
            sw.silu_and_mul_backward(dy, x)
            calls += 2
    if which in ("all", "cross_entropy"):
        ce = load("pipegoose/cross_entropy")
        for dt in dtypes:
            for v in (1, 7, 8, 9, 1000, 4097, 50257, 151936):   # 151936 (50257 in fp32): backward rows split
                rows = 5
                # rows of v + 1 columns (a view of the first v): every other row starts misaligned in 16-bit
                x = torch.randn(rows, v + 1, device="cuda", dtype=dt)[:, :v]
                t = torch.randint(0, v, (rows,), device="cuda")
                t[1] = -100          # ignored
                t[2] = v             # out of range: NaN
                loss, lse = ce.cross_entropy_forward(x, t, -100)
                ce.cross_entropy_backward(torch.ones(rows, device="cuda"), x, t, lse, -100)
                # the reduced forward (blocks arriving at a counter; the last one sums), the backward's grad_loss
                # expanded from one value (stride 0)
                for mean in (True, False):
                    out, lse, count = ce.cross_entropy_forward_reduced(x, t, -100, mean)
                ce.cross_entropy_backward(torch.ones((), device="cuda").expand(rows), x, t, lse, -100)
                # the gradient written over the logits (contiguous; odd v: misaligned rows in 16-bit)
                ce.cross_entropy_backward_(torch.ones((), device="cuda").expand(rows), x.contiguous(), t, lse, -100)
                calls += 6   # forward, backward, 2 reduced forwards, backward at stride 0, in-place backward
    if which in ("all", "rope"):
        rp = load("pipegoose/rope")

        # the same shape at element offset 1 of a buffer (not 16-byte aligned), in rows of D + 1 elements (strides no
        # multiple of the vector), and narrowed in the head dim from element 1 of rows of D + 2 (both): the scalar path
        def at_offset(t):
            return torch.randn(t.numel() + 1, device="cuda", dtype=t.dtype)[1:].view(t.shape)

        def in_longer_rows(t):
            return torch.randn(*t.shape[:-1], t.shape[-1] + 1, device="cuda", dtype=t.dtype)[..., :t.shape[-1]]

        def narrowed(t):
            return torch.randn(*t.shape[:-1], t.shape[-1] + 2, device="cuda", dtype=t.dtype)[..., 1:t.shape[-1] + 1]

        # (B, Hq, Hk, S, D, Bc): one element per half; head dims no multiple of the vector (6, 10: the scalar path;
        # 24 in 16-bit: 8-byte vectors, the staged kernel); one 16-bit vector per half (16); Llama's shapes; a last
        # block left partial (40 + 7 heads of 128 over 300 positions); no query heads, no key heads; a Llama-like
        # layer over 1024 positions
        shapes = ((1, 1, 1, 1, 2, 1), (3, 3, 1, 7, 6, 3), (3, 3, 1, 7, 10, 1), (2, 4, 2, 9, 24, 2),
                  (2, 4, 4, 33, 16, 1), (2, 32, 4, 33, 64, 2), (1, 40, 7, 300, 128, 1), (2, 0, 2, 5, 16, 1),
                  (2, 4, 0, 5, 16, 2), (2, 32, 8, 1024, 128, 1))
        for dt in dtypes:
            for b, hq, hk, s, d, bc in shapes:
                q, dq = (torch.randn(b, hq, s, d, device="cuda", dtype=dt) for _ in range(2))
                k, dk = (torch.randn(b, hk, s, d, device="cuda", dtype=dt) for _ in range(2))
                cos, sin = (torch.randn(bc, s, d, device="cuda", dtype=dt) for _ in range(2))
                rp.rope_forward(q, k, cos, sin)
                rp.rope_backward(dq, dk, cos, sin)
                calls += 2
                if s > 300:
                    continue
                for view in (at_offset, in_longer_rows, narrowed):
                    rp.rope_forward(view(q), view(k), view(cos), view(sin))
                    rp.rope_backward(view(dq), view(dk), view(cos), view(sin))
                    calls += 2
                # Llama's transposed projections ([B, S, H, D] viewed as [B, H, S, D]: outputs of that layout) and a
                # fused qkv projection's heads (neither dense nor contiguous)
                qt = torch.randn(b, s, hq, d, device="cuda", dtype=dt).transpose(1, 2)
                kt = torch.randn(b, s, hk, d, device="cuda", dtype=dt).transpose(1, 2)
                qkv = torch.randn(b, s, hq + 2 * hk, d, device="cuda", dtype=dt)
                qf, kf = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hk].transpose(1, 2)
                for qq, kk in ((qt, kt), (qf, kf)):
                    rp.rope_forward(qq, kk, cos, sin)
                    rp.rope_backward(qq, kk, cos, sin)
                    calls += 2
        # partial rotary (B, Hq, Hk, S, D, R, Bc): Pythia's quarter of a head (one 16-bit vector a half), R/2 and D - R
        # no multiple of the vector (the scalar path), an odd count of the widest vectors passed through (D 72, R 16),
        # GPT-NeoX's chunks of a fused [B, S, H, 3D] projection, fp32 tables with 16-bit q and k, and the misaligned
        # views
        for dt in dtypes:
            for b, hq, hk, s, d, r, bc in ((2, 16, 16, 64, 64, 16, 1), (2, 4, 2, 9, 64, 6, 1), (2, 4, 2, 9, 80, 20, 2),
                                           (3, 3, 1, 7, 128, 32, 3), (1, 2, 2, 5, 8, 2, 1), (2, 4, 2, 9, 88, 24, 1),
                                           (2, 3, 1, 5, 72, 16, 1)):
                qkv = torch.randn(b, s, hq, 3 * d, device="cuda", dtype=dt).transpose(1, 2)
                q, k = torch.randn(b, hq, s, d, device="cuda", dtype=dt), torch.randn(b, hk, s, d, device="cuda",
                                                                                        dtype=dt)
                for tdt in (dt,) if dt == torch.float32 else (dt, torch.float32):
                    cos, sin = (torch.randn(bc, s, r, device="cuda", dtype=tdt) for _ in range(2))
                    out = None if tdt == dt else dt
                    rp.rope_forward(q, k, cos, sin)
                    rp.rope_backward(q.to(tdt), k.to(tdt), cos, sin, out)
                    calls += 2
                    if hq == hk:
                        qn, kn, _ = qkv.chunk(3, dim=-1)
                        rp.rope_forward(qn, kn, cos, sin)
                        rp.rope_backward(qn.to(tdt), kn.to(tdt), cos, sin, out)
                        calls += 2
                for view in (at_offset, in_longer_rows, narrowed):
                    cos, sin = (torch.randn(bc, s, r, device="cuda", dtype=dt) for _ in range(2))
                    rp.rope_forward(view(q), view(k), view(cos), view(sin))
                    rp.rope_backward(view(q), view(k), view(cos), view(sin))
                    calls += 2
    torch.cuda.synchronize()
    print(f"sanitize_kernels: {calls} kernel calls done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
