#!/usr/bin/env bash
# Build llama.cpp from llama-cpp-python's source package (its vendored llama.cpp, its CMake project) for
# benchmarks/llama_cpp_check.py. Only the libraries the Python binding loads are built (ggml + llama, no tools,
# no multimodal library; needs a C++ compiler, cmake >= 3.21 and ninja): 52 of the 140 objects of a full `pip install`, ~35 min on 2 shared cores.
#
#   bash benchmarks/build_llama_cpp.sh [DIR] [VERSION]      # default DIR=build/llama-cpp, VERSION=0.3.36
#   export LLAMA_CPP_LIB_PATH=DIR/build/bin PYTHONPATH=DIR/src OMP_WAIT_POLICY=PASSIVE
#   python benchmarks/llama_cpp_check.py --quant q4_k
#
# OMP_WAIT_POLICY=PASSIVE: llama.cpp's OpenMP threads otherwise spin between ops and starve any other process on
# a small machine (a cache build beside it ran 17 x slower). A full wheel (`pip install --no-binary
# llama-cpp-python llama-cpp-python`) works the same where there is time for it.
set -euo pipefail
dir=${1:-build/llama-cpp}
version=${2:-0.3.36}
python=${PYTHON:-python}
mkdir -p "$dir"
cd "$dir"
if [ ! -d src ]; then
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d sdist
    mkdir -p src && tar xzf sdist/llama_cpp_python-"$version".tar.gz -C src --strip-components 1
fi
cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
ninja -C build llama
"$python" -m pip install --quiet diskcache jinja2  # what the binding imports besides numpy
echo "export LLAMA_CPP_LIB_PATH=$PWD/build/bin PYTHONPATH=$PWD/src OMP_WAIT_POLICY=PASSIVE"
