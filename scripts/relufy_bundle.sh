#!/usr/bin/env bash
# Packs, here, the text the relufy run on a GPU machine (scripts/relufy_gpu.sh) reads, into
# .gpu-corpus/ (git-ignored, carried by one call of its own):
#   corpus.npz  SmolLM2's tokens (uint16, compressed) of English documentation from Debian's
#               packages: python3.11-doc, linux-doc-6.1, perl-doc, python-django-doc,
#               postgresql-doc-15, python-pandas-doc, python-scipy-doc, git-doc, cmake-doc,
#               sphinx-doc, debian-handbook, and rust-doc's books and standard library pages;
#               python3.11-doc's tutorial/ is held out whole
#   eval/       the held-out text (python3.11-doc's tutorial/), for perplexity on prose never trained on
#   profile/    text the profiler reads after training (a slice of python3.11-doc's library/)
# Usage: scripts/relufy_bundle.sh [--max-tokens N]   (default 40000000)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX=40000000
if [ "${1:-}" = "--max-tokens" ]; then MAX=$2; fi
PKGS="python3.11-doc linux-doc-6.1 perl-doc python-django-doc debian-handbook rust-doc postgresql-doc-15 python-scipy-doc
      python-pandas-doc git-doc cmake-doc sphinx-doc"
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    [ "$(id -u)" = 0 ] || { echo "install as root: apt-get install $missing"; exit 1; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
PY=/usr/share/doc/python3.11/html/_sources
rm -rf .gpu-corpus && mkdir -p .gpu-corpus/eval .gpu-corpus/profile
cp -r "$PY/tutorial/." .gpu-corpus/eval/
profile_files=$(ls "$PY"/library/*.txt | head -120 || true)
cp $profile_files .gpu-corpus/profile/
# debian-handbook in English (its other folders are translations) and rust-doc's books and std pages
books=()
for d in /usr/share/doc/debian-handbook/html/en-US /usr/share/doc/rust-doc/html/book /usr/share/doc/rust-doc/html/reference \
         /usr/share/doc/rust-doc/html/rust-by-example /usr/share/doc/rust-doc/html/nomicon /usr/share/doc/rust-doc/html/cargo \
         /usr/share/doc/rust-doc/html/std; do
    [ -d "$d" ] && books+=("$d")
done
powerinfer-rs pack --corpus "$PY" /usr/share/doc/linux-doc-6.1/html/_sources /usr/share/perl/5.36/pod \
    /usr/share/doc/python-django-doc/html /usr/share/doc/postgresql-doc-15/html /usr/share/doc/python-pandas-doc/html/_sources \
    /usr/share/doc/python-scipy-doc/html /usr/share/doc/git-doc /usr/share/doc/cmake-doc/html \
    /usr/share/doc/sphinx-doc/html/_sources "${books[@]}" --eval "$PY/tutorial" --max-tokens "$MAX" -o .gpu-corpus/corpus.npz
du -sh .gpu-corpus .gpu-corpus/*
