# Sourced (not run) by run_h200.sh and run_serving_h200.sh from the repository root; $1 names the caller in its
# messages. If .peers/ holds FlashInfer (built on a CPU machine by ../shared/peers/flashinfer_carry.sh: a trimmed
# flashinfer-python 0.7.4, its MLA modules precompiled for sm_90a, the apache-tvm-ffi wheel), unpack it into /tmp/site
# and put that on PYTHONPATH, exactly as that script's header says. Without it the FlashInfer rows are reported as
# skipped, with the import error.
if [ -f .peers/flashinfer_trim.tar.xz ]; then
  mkdir -p /tmp/site
  tar xJf .peers/flashinfer_trim.tar.xz -C /tmp/site
  if [ -f .peers/fi_aot.tar.gz ]; then
    tar xzf .peers/fi_aot.tar.gz -C /tmp/site
  else
    echo "$1: no .peers/fi_aot.tar.gz: FlashInfer will compile its MLA modules here (minutes)"
  fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl \
    || echo "$1: installing the apache-tvm-ffi wheel failed; FlashInfer's import will say why"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "$1: no .peers/flashinfer_trim.tar.xz: the FlashInfer rows will be skipped"
fi
