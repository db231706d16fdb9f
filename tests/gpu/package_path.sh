# Sourced by tests/gpu/run_gpu_tier.sh and benchmarks/gpu_steps.sh: atomrt importable from a
# checkout on a machine where it is not installed.
#   atomrt_package TREE   prints a new folder whose `atomrt` package links TREE's top-level folders
#   atomrt_wheels DIR     installs the wheels in .whl/, if any, offline (no index, no dependencies)
#                         into DIR/site and prints ":DIR/site" (nothing when there are none)
atomrt_package() {
  local pp d
  pp=$(mktemp -d)
  mkdir -p "$pp/atomrt"
  for d in runtime workers compile graphs distributed; do ln -s "$1/$d" "$pp/atomrt/$d"; done
  ln -s "$1/atomrt/__init__.py" "$pp/atomrt/__init__.py"  # the user's names (`from atomrt import LLM`)
  echo "$pp"
}
atomrt_wheels() {
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$1/site" .whl/*.whl >&2 || echo "wheels in .whl/ did not install" >&2
    echo ":$1/site"
  fi
}
