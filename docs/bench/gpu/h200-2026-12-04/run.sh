#!/bin/bash
# One device call: install the carried wheels, build the row kernel, run the CUDA tests, the unit tier and three
# local clusters with trainers on cuda. Everything goes to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
L=$OUT/gpu.log
{
nvidia-smi -L; nproc
python3 -c 'import torch, grpc, google.protobuf as p, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0), "grpc", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)'
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
python3 -c 'from psserver.protocol.rows import kernel; print("row kernel:", "native" if kernel.native else "numpy")'
echo "=== CUDA tests $(date +%T)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda_path.py tests/unit/test_embedding.py tests/unit/test_staging.py tests/unit/test_device.py -rs 2>&1 | tail -15
echo "=== unit tier $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit 2>&1 | tail -12
for args in "--mode sync --epochs 3" "--dataset criteo-synth --mode sync --embedding-mode async --steps 300" "--dataset movielens100k --mode sync --epochs 2"; do
  echo "=== ps-cluster --device cuda $args $(date +%T)"
  d=/tmp/run-$RANDOM
  timeout 90 python3 -c 'from trainer.local.cluster import entrypoint; entrypoint()' --device cuda $args --run-dir $d 2>&1 | tail -25
  cp $d/summary.json $OUT/summary-$(echo $args | tr -c 'a-z0-9\n' '_' | cut -c1-40).json 2>/dev/null
done
echo "=== done $(date +%T)"
} 2>&1 | tee $L
