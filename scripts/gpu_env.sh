# Sourced on the GPU machine from the project root (`source .whl/gpu-env.sh`; scripts/gpu_wheels.sh copies
# it there): installs the carried wheels and puts the
# project on the path. Python there is 3.12 with torch 2.11+cu130.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING" || true
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
