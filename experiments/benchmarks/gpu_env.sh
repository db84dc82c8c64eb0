# Source from the repository root on the GPU machine, after `../shared/tools/gpu-prep` copied the
# wheels into ./.whl (carried with the working tree):  source experiments/benchmarks/gpu_env.sh
# Installs gin-config, grain and fla into /tmp/site, plus the wheels in .whl/extra (tqdm,
# tensorboardX, matplotlib and their dependencies) only for the packages the image lacks, so that
# the image's own numpy, protobuf and friends stay in charge. Nothing is downloaded.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
for pkg in tqdm:tqdm tensorboardX:tensorboardx matplotlib:matplotlib; do
  mod=${pkg%%:*}; whl=${pkg##*:}
  if ! python3 -c "import $mod" 2>/dev/null; then
    if [ "$mod" = matplotlib ]; then
      for dep in contourpy cycler fonttools kiwisolver pyparsing python_dateutil pillow; do
        python3 -c "import ${dep/python_dateutil/dateutil}" 2>/dev/null && continue
        [ "$dep" = fonttools ] && python3 -c "import fontTools" 2>/dev/null && continue
        [ "$dep" = pillow ] && python3 -c "import PIL" 2>/dev/null && continue
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/${dep}-*.whl
      done
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/${whl}-*.whl
  fi
done
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import gin, grain, tqdm, tensorboardX, matplotlib, jax; print('gpu_env: jax', jax.__version__, jax.devices())"
