"""Compile diffzoo's Triton kernels for sm_90 with Triton's real compiler (no GPU needed) and print,
as JSON, ptxas's registers and stack bytes per kernel for the launch configurations the layer uses.

Run without TRITON_INTERPRET (the interpreter's kernels cannot be compiled):
    python tests/layers/sm90_resources.py 77 197 4096
"""
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from diffzoo.layers.kernels import split_triton as st

FP32 = {'KB', 'LAM', 'LSE', 'DW', 'DELTA'}
POINTERS = FP32 | {'Q', 'K', 'V', 'W', 'Y', 'D', 'G', 'DD', 'DD_LO', 'DQ', 'DK', 'DV'}


def resources(kernel, constexprs, launch, workdir: Path):
    signature = {
        name: 'constexpr' if name in constexprs else ('*fp32' if name in FP32 else '*bf16') if name in POINTERS
        else 'fp32' if name in ('qk_scale', 'sm_scale', 'eps') else 'i32'
        for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget('cuda', 90, 32),
                              options={'num_warps': launch.warps, 'num_stages': launch.stages})
    cubin = workdir / f'{kernel.__name__}.cubin'
    cubin.write_bytes(compiled.asm['cubin'])
    tool = Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump'
    usage = subprocess.run([str(tool), '--dump-resource-usage', str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return {k: int(v) for k, v in re.findall(r'(REG|STACK):(\d+)', usage)}


def main(tokens):
    rows = []
    with tempfile.TemporaryDirectory() as workdir:  # the cubins cuobjdump reads, removed with it
        for n in tokens:
            for causal in (False, True):
                common = dict(HEAD_D=64, HEAD_DV=128, BLOCK_D=64, BLOCK_DV=128, IS_CAUSAL=causal, HAS_BIAS=not causal,
                              PRECISION='tf32', DOT_UPCAST=False)
                fwd, dq, dkdv = (st.launch_config(k, n, 64, 128, 'sm_90') for k in st.KERNELS)
                for kernel, constexprs, launch in (
                        (st._diff_attn_fwd, dict(common, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n,
                                                 ONE_TILE=fwd.one_tile, STORE_STATS=True),
                         fwd),
                        (st._diff_attn_bwd_dq, dict(common, BLOCK_M=dq.block_m, BLOCK_N=dq.block_n,
                                                    ONE_TILE=dq.one_tile, HAS_LO=False),
                         dq),
                        (st._diff_attn_bwd_dkdv, dict(common, BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n), dkdv),
                        (st._diff_attn_norm_bwd, dict(HEAD_DV=128, BLOCK_DV=128, BLOCK_R=32, WRITE_Y=True,
                                                       WRITE_LO=False),
                         st.Launch(0, 0, 4))):
                    rows.append({'kernel': kernel.__name__, 'tokens': n, 'causal': causal, 'num_warps': launch.warps,
                                 'num_stages': launch.stages, 'block_m': launch.block_m, 'block_n': launch.block_n,
                                 **resources(kernel, constexprs, launch, Path(workdir))})
    print(json.dumps(rows))


if __name__ == '__main__':
    main([int(t) for t in sys.argv[1:]])
