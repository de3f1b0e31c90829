"""python -m diffzoo.bench.gpu OUT [STEP ...]: the project's GPU checks in one time-boxed run on a CUDA machine.

Steps, the first four by default (600 s together on CUDA: the run fits 10 minutes), the others by name (each a
few commands; the seconds are each step's time box on CUDA; `--plan` prints them and runs nothing):
  tests     165 s  the CUDA device loader's tests first (tests/train/test_device_data.py: the device data
                   backend's exactness, which its CUDA default waits on), the kernel tests on CUDA
                   (tests/layers/test_kernels.py and the official checkpoint's CUDA test), which rows of
                   split_kernel="auto"'s table they support (OUT/dispatch.json), the fp16 λ gradient's error row by
                   row and in the layer whole, on the GPU test's own layer and draws at 4096 tokens, batch 256
                   (python -m diffzoo.bench.lambda_error --as-test, OUT/lambda-error.json), every
                   other test marked gpu (pytest -m gpu), then per sample beside each path's rounding modelled
                   (python -m diffzoo.bench.lambda_rounding, OUT/lambda-rounding.json); needs the repository's tests/
  bench     155 s  python -m diffzoo.bench, model and steps sections in bf16: diffclip-b16 on the default path,
                   diffclip-b16@two_calls and the baseline, each step timed in interleaved blocks, then consecutive
                   steps profiled, the slowest against the fastest (OUT/bench.json, OUT/bench-steps.txt);
                   diffclip-b16 alone (OUT/bench-alone.json); the host's time a layer call (python -m
                   diffzoo.bench.host, OUT/bench-host.json); in what is left, the model section again in fp16
                   with a gradient scaler (OUT/bench-fp16.json)
  compile   145 s  the model section with both towers under torch.compile, graph breaks counted as they run
                   (OUT/bench-compile.json)
  commands  135 s  diffclip-b16-cc3m through scripts/train.sh on every default and clip-b16-baseline-cc3m on
                   open_clip's own pipeline, in one job on synthetic shards: images/s per GPU, their ratio (the
                   moonshot: at least 1), the share of each step waiting for data; an all_reduce over NCCL; see
                   diffzoo.bench.gpu.commands
  tune      300 s  python -m diffzoo.bench.tune --write: the Triton split kernel's launches for this GPU
                   (OUT/tune.json; the package's launch_configs.json, copied to OUT)
  extras    200 s  scripts/train.sh diffclip-tiny on a synthetic corpus; a VLM fine-tuning stage on a tiny
                   PaliGemma; the eRAM-V bench (OUT/eramv.json)
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
shards on GPUs only; the commands get 4 times their CUDA time boxes): every command and its record; it prints
the plan first, as every run does.
"""
