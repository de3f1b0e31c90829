"""python -m diffzoo.bench.gpu OUT [STEP ...]: the project's GPU checks in one time-boxed run on a CUDA machine.

Steps, in this order by default (each a few commands; the seconds are each step's time box on CUDA):
  tune      300 s  python -m diffzoo.bench.tune --write: the Triton split kernel's launches for this GPU
                   (OUT/tune.json; the package's launch_configs.json, copied to OUT)
  tests     420 s  the kernel tests on CUDA (tests/layers/test_kernels.py and the official checkpoint's CUDA
                   test), then every other test marked gpu (pytest -m gpu); needs the repository's tests/
  bench     300 s  python -m diffzoo.bench, layer, model and profile sections: the Triton kernel against the
                   default SDPA kernel (two_calls) and the baseline, in one run (OUT/bench.json)
  compile   300 s  the model section with both towers under torch.compile (OUT/bench-compile.json)
  commands  250 s  scripts/train.sh diffclip-tiny on a synthetic corpus; diffclip-b16-cc3m and
                   clip-b16-baseline-cc3m through train.sh (images/s per GPU, their ratio, the share of each
                   step waiting for data); a VLM fine-tuning stage on a tiny PaliGemma; the eRAM-V bench
                   (OUT/eramv.json); see diffzoo.bench.gpu.commands
  stages    720 s  the LLaVA-style stages 1 -> 2 -> 3 of python -m diffzoo.train.vlm on a tiny DiffCLIP tower
                   and Qwen2-style LM in bf16, and stage 3 again under FSDP2 through torchrun
  data      300 s  python -m diffzoo.bench.data_profile: diffclip-b16's data path taken apart, 8 workers at batch
                   256: worker CPU a sample, each stage of the device backend's making of a batch, a training
                   step's wait for data on each backend (OUT/data_profile.json)

Every command runs in its own process group under its time box (cut to what is left of --budget, the whole
run's deadline); one that fails or times out (its process group ended) is recorded and the next one runs, and
one left with under 5 s is skipped and recorded as such. OUT/gpu_check.json holds every command's record
(step, status ok | failed | timed out | skipped, exit status, seconds, time box, command) and what the steps
measured; it is rewritten after each command. OUT/gpu_check.log holds every command's output, in order.
A table ends the run; the exit status is 1 when a command failed or timed out.

--device cpu is a dry run of the same steps on the CPU at tiny sizes (the Triton interpreter, smoke-sized
benches, the tests marked gpu collected and skipped, 4-step trainings; the FSDP stage is skipped: accelerate
shards on GPUs only; the commands get 4 times their CUDA time boxes): every command and its record, in about
20 minutes on 2 busy cores.
"""
