# Helpers the setup scripts source.

# find_python: the command of a Python 3.12 interpreter.
find_python() {
  for cmd in "python3.12" "env PYENV_VERSION=3.12.1 python3.12" "python3"; do
    if $cmd -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cmd"; return 0
    fi
  done
  echo "jax-flash needs Python 3.12 (python3.12 not found)" >&2
  return 1
}

# pinned_jax FILE: the jax version a constraints file pins.
pinned_jax() {
  sed -n 's/^jax==//p' "$1"
}
