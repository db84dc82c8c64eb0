# Source from the repository root on the GPU machine, after `../shared/tools/gpu-prep` copied the
# wheels into ./.whl (carried with the working tree):  source experiments/benchmarks/gpu_env.sh
# Installs gin-config, grain, fla and tokamax into /tmp/site, plus the wheels in .whl/extra (tqdm,
# tensorboardX, matplotlib and their dependencies, flatbuffers for jax.export; put there by hand,
# `pip download`, for the training job) only for the packages the image lacks, so that the image's own numpy, protobuf and
# friends stay in charge. Nothing is downloaded. The kernel benchmarks need none of the extras: a
# missing one is reported, not fatal.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
# tokamax (the MoE's grouped matmul and the document-masked attention) and its dependencies; the
# image's jax 0.11.2 is the one setup.cfg pins.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/tokamax/*.whl \
  || return 1
_extra() {  # installs .whl/extra/$1-*.whl if present; returns 1 if it is not
  set -- .whl/extra/$1-*.whl
  [ -e "$1" ] || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@"
}
for pkg in tqdm:tqdm tensorboardX:tensorboardx matplotlib:matplotlib flatbuffers:flatbuffers; do
  mod=${pkg%%:*}; whl=${pkg##*:}
  python3 -c "import $mod" 2>/dev/null && continue
  if [ "$mod" = matplotlib ]; then
    for dep in contourpy cycler fonttools kiwisolver pyparsing python_dateutil pillow; do
      python3 -c "import ${dep/python_dateutil/dateutil}" 2>/dev/null && continue
      [ "$dep" = fonttools ] && python3 -c "import fontTools" 2>/dev/null && continue
      [ "$dep" = pillow ] && python3 -c "import PIL" 2>/dev/null && continue
      _extra "$dep" || echo "gpu_env: no wheel for $dep in .whl/extra (needed by matplotlib)"
    done
  fi
  _extra "$whl" || echo "gpu_env: $mod is not in the image and has no wheel in .whl/extra" \
    "(the training job needs it; the kernel benchmarks do not)"
done
unset -f _extra
export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# fla autotunes each kernel for minutes per new shape on a fresh machine. fla 0.6.0 asks Triton
# (>= 3.4) to keep the results on disk: keep Triton's cache in the tree (.triton_cache, ignored by
# git) so that `save_autotune` can return them through $OUT and a later call can carry them back
# (carry ".triton_cache" after unpacking triton_autotune.tar there). Only the autotune choices
# travel, not compiled kernels: Triton recompiles the chosen configs.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
save_autotune() {
  local tarball="$OUT/triton_autotune.tar"
  (cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' | tar -cf "$tarball" -T - \
    && echo "gpu_env: $(tar -tf "$tarball" | wc -l) autotune results in \$OUT/triton_autotune.tar")
}
python3 -c "import gin, grain, jax, tokamax; print('gpu_env: jax', jax.__version__, 'tokamax',
  tokamax.__version__, jax.devices())"
