"""Compile every Triton kernel of the package for Hopper (sm_90) without a GPU.

    python tools/compile_check.py          # TRITON_INTERPRET must not be set

The Triton interpreter, which runs the kernels in CI, accepts code the compiler rejects
(a module-level constant read inside a kernel cost a device run this way). This compiles
each kernel through Triton's real pipeline down to a cubin (ptxas ships with the
`triton` wheel) for the shapes the op launches on H200, and prints each kernel's
shared memory and cubin size. No GPU and no CUDA driver are needed; the CPU test suite
runs it (tests/test_kernels.py).
"""

from __future__ import annotations

import os
import sys
import time


def _signature(pointers: dict, scalars: dict, constexprs: dict) -> dict:
    sig = {**pointers, **scalars}
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def _gemm2_signature(desc: str, constexprs: dict) -> dict:
    """Both GEMM2 kernels' argument list (x and weight descriptors of type `desc`)."""
    return _signature({"x_desc": desc, "w_desc": desc, "y_ptr": "*bf16",
                       "row_start_ptr": "*i32", "tile_start_ptr": "*i32",
                       "ready_ptr": "*i32",  # (the token index, or FROM_DEST dest)
                       "token_ptr": "*i32" if constexprs.get("FROM_DEST") else "*i64",
                       "marks_ptr": "*i32"},
                      {n: "i32" for n in ("num_experts", "K", "N", "split_width",
                                          "num_splits", "dest_rows", "topk", "stride_ym",
                                          "stride_yn")}, constexprs)


def kernels():
    """(name, jit function, signature, constexprs, options, attrs) per kernel and mode."""
    from megatron_overlap.kernels import gather_rs as grs
    from megatron_overlap.kernels import gemm2
    from megatron_overlap.kernels import routing_table as rt
    from megatron_overlap.kernels import sum_partials as sp

    flags = {n: "*i32" for n in ("ready_ptr", "done_ptr", "error_ptr", "tile_start_ptr")}
    comm_ptrs = {"y_ptr": "*bf16", "table_ptr": "*i32", "prob_ptr": "*bf16",
                 "dst_ptrs": "*i64", "signal_ptrs": "*i64", **flags,
                 "partial_like_ptr": "*bf16", "epoch_ptr": "*i32", "record_ptr": "*i32"}
    comm_ints = {n: "i32" for n in ("tokens_per_rank", "N", "split_width", "num_splits", "rank",
                                    "world", "topk", "num_experts", "gemm_col_tiles",
                                    "gemm_last_col_tiles",
                                    "max_spins", "timeout_us", "kind",
                                    "pid_base", "comm_programs", "helpers",
                                    "stride_ym", "stride_yn")}
    comm_ints.update(dst_slot_stride="i64", dst_row_stride="i32")
    comm_ints.pop("stride_yn")  # y is row-major: Triton specializes a stride of 1
    # what Triton's launcher marks 16-divisible on the device (pointers, hidden sizes and
    # strides of the shapes the op launches), so vectorization and cp.async match it
    names = grs.gather_rs_kernel.arg_names
    aligned = [n for n in names if n.endswith(("_ptr", "_ptrs"))
               or n in ("N", "split_width", "stride_ym", "dst_slot_stride", "dst_row_stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    # (slot loop, item rows, stages, token-major y)
    for slot_loop, rows, stages, tokens in (
            (True, 64, 1, False), (False, 64, 1, False), (True, 16, 2, False),
            (True, 64, 1, True), (True, 32, 2, True)):
        meta = dict(BLOCK_TM=rows, BLOCK_TN=1024, TOPK_POW2=4, HAS_PROBS=False, COL_ALIGN=16,
                    SLOT_LOOP=slot_loop, ITEM_STAGES=stages, TOKEN_MAJOR=tokens, stride_yn=1)
        name = f"gather_rs slot_loop={slot_loop} item_stages={stages}" + " token_major" * tokens
        yield (name, grs.gather_rs_kernel, _signature(comm_ptrs, comm_ints, meta), meta,
               dict(num_warps=32), attrs)
    # the shared placement's small CTA beside GEMM2's (4 warps, capped registers)
    from megatron_overlap.ops import SHARED_COMM_MAXNREG, SHARED_GEMM_MAXNREG

    meta = dict(BLOCK_TM=8, BLOCK_TN=512, TOPK_POW2=4, HAS_PROBS=False, COL_ALIGN=16,
                SLOT_LOOP=True, ITEM_STAGES=1, TOKEN_MAJOR=True, stride_yn=1)
    yield ("gather_rs shared placement token_major", grs.gather_rs_kernel,
           _signature(comm_ptrs, comm_ints, meta), meta,
           dict(num_warps=4, maxnreg=SHARED_COMM_MAXNREG), attrs)
    yield ("agreement", grs.agreement_kernel,
           _signature({"signal_ptrs": "*i64", "state_ptr": "*i32", "error_ptr": "*i32",
                       "record_ptr": "*i32"},
                      {n: "i32" for n in ("rank", "world", "tokens", "N", "kind",
                                          "max_spins", "timeout_us")}, {}),
           {}, dict(num_warps=1), None)
    yield ("sum_partials", sp.sum_partials_kernel,
           _signature({"recv_ptr": "*bf16", "out_ptr": "*bf16", "epoch_ptr": "*i32"},
                      {"numel": "i32", "slot_stride": "i32", "parity_stride": "i32"},
                      {"WORLD": 0, "BLOCK": 0}),
           dict(WORLD=2, BLOCK=2048), dict(num_warps=4), None)
    # (row order; token-major y with places read from dest or counted from the marks)
    for scatter, from_dest in ((False, False), (True, True), (True, False)):
        meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EXPERTS_POW2=64, UPCAST=False,
                    COL_ALIGN=16, FLATTEN=False, SCATTER=scatter,
                    MARK_WORDS=2 if scatter else 1, FROM_DEST=from_dest)
        yield (f"grouped_gemm2 scatter={scatter}" + " from_dest" * from_dest,
               gemm2.grouped_gemm2_kernel,
               _gemm2_signature("tensordesc<bf16[128,64]>", meta), meta,
               dict(num_warps=4, num_stages=3), None)
    from megatron_overlap.kernels import gemm2_ws
    from triton.experimental.gluon import language as gl

    layout = repr(gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16))
    shared = SHARED_GEMM_MAXNREG["gluon"]
    for publisher, maxnreg, from_dest in ((True, gemm2_ws.MAXNREG, True),
                                          (False, gemm2_ws.MAXNREG, True),
                                          (True, shared, True), (True, shared, False)):
        meta = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SEARCH_STEPS=6, STAGES=3,
                    COL_ALIGN=16, SCATTER=True, MARK_WORDS=2, FROM_DEST=from_dest,
                    PUBLISHER=publisher)
        yield (f"grouped_gemm2_ws publisher={publisher} maxnreg={maxnreg}"
               + " from_marks" * (not from_dest),
               gemm2_ws.grouped_gemm2_ws_kernel,
               _gemm2_signature(f"tensordesc<bf16[128,64],{layout}>", meta), meta,
               dict(num_warps=4, maxnreg=maxnreg), None)
    from megatron_overlap.kernels import swiglu

    for k in (1408, 512):
        block_r, block_k = swiglu.block_shape(k)
        for has_valid in (False, True):
            meta = dict(K=k, BLOCK_R=block_r, BLOCK_K=block_k, HAS_VALID=has_valid)
            yield (f"weighted_swiglu K={k} valid_rows={has_valid}",
                   swiglu.weighted_swiglu_kernel,
                   _signature({"inter_ptr": "*bf16", "probs_ptr": "*fp32", "out_ptr": "*bf16",
                               "valid_ptr": "*i64"}, {"rows": "i32"}, meta), meta,
                   dict(num_warps=4),
                   {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    from megatron_overlap.kernels import gated_add, gather_rows

    row_kernels = (  # (name, module, its pointers, the 16-byte aligned ones, widths H)
        ("gather_rows", gather_rows, {"src_ptr": "*bf16", "index_ptr": "*i64",
                                      "valid_ptr": "*i64", "out_ptr": "*bf16"}, (0, 3),
         (2048, 1536)),
        ("gated_add", gated_add, {"out_ptr": "*bf16", "shared_ptr": "*bf16",
                                  "logit_ptr": "*bf16"}, (0, 1), (2048, 5120)),
    )
    for name, module, pointers, aligned, widths in row_kernels:
        for h in widths:
            block_r, block_h = module.block_shape(h)
            meta = dict(H=h, BLOCK_R=block_r, BLOCK_H=block_h)
            yield (f"{name} H={h}", getattr(module, f"{name}_kernel"),
                   _signature(pointers, {"rows": "i32"}, meta), meta, dict(num_warps=4),
                   {(i,): [["tt.divisibility", 16]] for i in aligned})
    from megatron_overlap.kernels import sum_rows  # (the permutation's backward)

    for h in (2048, 1536):  # (Triton 3.6 rejects a masked 1-D load in its loop at some shapes)
        block_t, block_h = sum_rows.block_shape(h)
        meta = dict(H=h, BLOCK_T=block_t, BLOCK_H=block_h)
        yield (f"sum_rows H={h}", sum_rows.sum_rows_kernel,
               _signature({"rows_ptr": "*bf16", "order_ptr": "*i64", "starts_ptr": "*i64",
                           "out_ptr": "*bf16"}, {"num_src": "i32"}, meta), meta,
               dict(num_warps=4), {(0,): [["tt.divisibility", 16]],
                                   (3,): [["tt.divisibility", 16]]})
    marks_ptrs = {"token_index_ptr": "*i64", "offsets_ptr": "*i32", "table_ptr": "*i32",
                  "marks_ptr": "*i32", "error_ptr": "*i32", "packed_ptr": "*i32"}
    for from_counts, padded in ((False, False), (True, True)):
        meta = dict(BLOCK_R=128, EXPERTS_POW2=64, TOPK_POW2=4, FILL_CHUNK=256, SPAN=8,
                    FROM_COUNTS=from_counts, PADDED=padded)
        yield (f"routing_table marks from_counts={from_counts}" + " padded" * padded,
               rt.routing_marks_kernel,
               _signature(marks_ptrs, {n: "i32" for n in (
                   "num_rows", "num_tokens", "topk", "num_experts", "words", "block_m",
                   "fill_per_program")}, meta), meta, dict(num_warps=4), None)
    meta = dict(BLOCK_R=128, EXPERTS_POW2=64, WORDS_POW2=2, SPAN=8, WRITE_DEST=True)
    yield ("routing_table slots dest=True", rt.routing_slots_kernel,
           _signature({"token_index_ptr": "*i64", "row_start_ptr": "*i32", "table_ptr": "*i32",
                       "dest_ptr": "*i32", "marks_ptr": "*i32", "error_ptr": "*i32"},
                      {n: "i32" for n in ("num_rows", "num_tokens", "topk", "num_experts",
                                          "words")},
                      meta), meta, dict(num_warps=4), None)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels it would compile")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for name, fn, signature, constexprs, options, attrs in kernels():
        t0 = time.perf_counter()
        try:
            source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
            compiled = triton.compile(source(fn=fn, signature=signature,
                                             constexprs=constexprs, attrs=attrs),
                                      target=target, options=options)
        except Exception as err:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"FAILED {name}: {type(err).__name__}: {str(err)[:400]}")
            continue
        meta = compiled.metadata
        async_copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
        print(f"ok {name}: {time.perf_counter() - t0:.1f} s, shared {meta.shared} B, "
              f"{len(compiled.asm['cubin'])} B cubin, {async_copies} async copies")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
