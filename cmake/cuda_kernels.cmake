# dtune_cuda_kernels(<owner> <.cu sources...>): builds the sources with nvcc into <owner>_cuda, links
# it into <owner> and defines DTUNE_WITH_CUDA_KERNELS=1 there, where libtorch has CUDA and nvcc is
# found; otherwise nothing (the owner's code keeps its ATen fallback). A separate library so that
# nvcc never sees the precompiled headers or the C++ warning flags; the kernels include no torch
# headers (launchers take plain pointers and an opaque stream). CMAKE_CUDA_ARCHITECTURES picks the
# GPUs (default: Ampere and Hopper, 80;90).
set(DTUNE_CUDA_KERNELS OFF)
if(DTUNE_HAS_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(DTUNE_CUDA_KERNELS ON)
    message(STATUS "dtune: fused CUDA kernels on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
  else()
    message(WARNING "dtune: libtorch has CUDA but no nvcc was found: the fused CUDA kernels are off "
                    "(set CMAKE_CUDA_COMPILER to enable them)")
  endif()
endif()

function(dtune_cuda_kernels owner)
  if(NOT DTUNE_CUDA_KERNELS OR ARGC LESS 2)
    return()
  endif()
  add_library(${owner}_cuda STATIC ${ARGN})
  set_target_properties(${owner}_cuda PROPERTIES CUDA_STANDARD 17 CUDA_RUNTIME_LIBRARY Shared
                                                 POSITION_INDEPENDENT_CODE ON)
  target_include_directories(${owner}_cuda PRIVATE ${PROJECT_SOURCE_DIR}/src)
  # cuBLASLt: the GEMMs with epilogues (models/cuda/epilogue_gemm.cu); libtorch loads it anyway.
  target_link_libraries(${owner}_cuda PUBLIC CUDA::cudart CUDA::cublasLt)
  target_link_libraries(${owner} PRIVATE ${owner}_cuda)
  target_compile_definitions(${owner} PRIVATE DTUNE_WITH_CUDA_KERNELS=1)
endfunction()
