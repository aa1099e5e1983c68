# Finds libtorch. Order: an explicit Torch_DIR / CMAKE_PREFIX_PATH, else the pip-installed torch
# that `python3 -c 'import torch'` sees. A CUDA build of torch enables CUDA (it needs nvcc/the CUDA
# toolkit at configure time); a CPU build needs nothing more.

if(NOT Torch_DIR)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import torch; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE DTUNE_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE DTUNE_TORCH_PY_RC ERROR_QUIET)
    if(DTUNE_TORCH_PY_RC EQUAL 0 AND DTUNE_TORCH_PREFIX)
      list(APPEND CMAKE_PREFIX_PATH "${DTUNE_TORCH_PREFIX}")
    endif()
  endif()
endif()

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "libtorch not found. Run scripts/setup.sh (installs the pip torch), or pass "
    "-DCMAKE_PREFIX_PATH=<libtorch or torch.utils.cmake_prefix_path>.")
endif()
message(STATUS "dtune: libtorch ${Torch_VERSION} from ${Torch_DIR}")

# The pip CUDA builds of libtorch export libstdc++'s std::filesystem symbols from libtorch.so, a
# stub with no libstdc++ of its own. A binary that lists libtorch.so before libstdc++.so binds its
# std::filesystem calls to those copies, which crash (seen with torch 2.11+cu130: remove_all
# called through a null pointer). Naming libstdc++ right before the torch libraries, not subject
# to --as-needed, makes it the first DT_NEEDED entry, so the dynamic linker binds to it.
set(DTUNE_LIBSTDCXX_FIRST "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state")

# TORCH_CXX_FLAGS carries the ABI define; keep it on every target.
separate_arguments(DTUNE_TORCH_CXX_FLAGS UNIX_COMMAND "${TORCH_CXX_FLAGS}")
add_compile_options(${DTUNE_TORCH_CXX_FLAGS})

set(DTUNE_HAS_CUDA OFF)
if(TARGET torch_cuda OR CUDA_FOUND OR CUDAToolkit_FOUND)
  set(DTUNE_HAS_CUDA ON)
endif()
message(STATUS "dtune: CUDA in libtorch: ${DTUNE_HAS_CUDA}")

# An interface target for "uses torch": include dirs as SYSTEM (no warnings from torch headers).
add_library(dtune_torch INTERFACE)
target_link_libraries(dtune_torch INTERFACE ${DTUNE_LIBSTDCXX_FIRST} ${TORCH_LIBRARIES})
# Some torch builds (2.11) ship their own nlohmann/json.hpp of another version; ours must come
# first everywhere, or targets disagree on nlohmann's ABI namespace and fail to link.
target_include_directories(dtune_torch SYSTEM INTERFACE
  $<TARGET_PROPERTY:nlohmann_json::nlohmann_json,INTERFACE_INCLUDE_DIRECTORIES> ${TORCH_INCLUDE_DIRS})
if(DTUNE_HAS_CUDA)
  target_compile_definitions(dtune_torch INTERFACE DTUNE_WITH_CUDA=1)
endif()

# One precompiled header (cmake/torch_pch.h) for ATen, built once and reused by every target that
# opts in with dtune_torch_pch(<target>): a TU that includes ATen drops from ~10-30 s to ~3 s.
if(DTUNE_USE_PCH)
  add_library(dtune_pch STATIC "${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp")
  target_link_libraries(dtune_pch PUBLIC dtune_torch)
  target_precompile_headers(dtune_pch PRIVATE "${PROJECT_SOURCE_DIR}/cmake/torch_pch.h")
endif()

if(DTUNE_USE_PCH)
  add_library(dtune_nn_pch STATIC "${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp")
  target_link_libraries(dtune_nn_pch PUBLIC dtune_torch)
  target_precompile_headers(dtune_nn_pch PRIVATE "${PROJECT_SOURCE_DIR}/cmake/torch_nn_pch.h")
endif()

# For targets made of torch::nn modules (models, and tests of them).
function(dtune_torch_nn_pch target)
  if(DTUNE_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM dtune_nn_pch)
  endif()
endfunction()

function(dtune_torch_pch target)
  if(DTUNE_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM dtune_pch)
  endif()
endfunction()
