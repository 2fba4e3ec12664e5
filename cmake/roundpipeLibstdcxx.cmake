# roundpipe_libstdcxx_first(<target> <path variable>): an INTERFACE IMPORTED
# target that puts the shared libstdc++ first among the libraries a binary
# needs. libtorch.so exports its own (incomplete) copy of std::filesystem and
# private copies of some other libstdc++ functions (std::exception_ptr's,
# among others); with libstdc++ needed first, ours resolve there. It is named
# by the path of the shared library: a bare -lstdc++ linked the static archive
# into the Python module on the GPU machine, whose private iostream code then
# crashed on the shared library's locale. The path is asked of the compiler
# that builds the binary, so the installed package carries no path of the
# machine roundpipe was built on (roundpipeConfig.cmake calls this too).
function(roundpipe_libstdcxx_first target path_var)
  set(path stdc++)
  foreach(name libstdc++.so libstdc++.so.6)
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=${name}
      OUTPUT_VARIABLE found OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(IS_ABSOLUTE "${found}" AND EXISTS "${found}")
      set(path "${found}")
      break()
    endif()
  endforeach()
  add_library(${target} INTERFACE IMPORTED)
  set_property(TARGET ${target} PROPERTY INTERFACE_LINK_LIBRARIES
    -Wl,--push-state,--no-as-needed "${path}" -Wl,--pop-state)
  set(${path_var} "${path}" PARENT_SCOPE)
endfunction()
