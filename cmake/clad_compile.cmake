# Compiler launcher of the Clad translation unit (CXX_COMPILER_LAUNCHER of zoo_clad): runs the
# compile, then fails it if Clad reported a call it could not differentiate. Clad only warns
# there ("attempted differentiation of function ... without definition", or a fallback to
# numerical differentiation) and takes that derivative as zero; -Werror does not reach plugin
# diagnostics. Usage: cmake -P clad_compile.cmake -- <compiler> <arguments>...
set(cmd)
set(output)
set(after_dashes FALSE)
set(next_is_output FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE 0 ${last})
  set(arg "${CMAKE_ARGV${i}}")
  if(after_dashes)
    list(APPEND cmd "${arg}")
    if(next_is_output)
      set(output "${arg}")
    endif()
    if(arg STREQUAL "-o")
      set(next_is_output TRUE)
    else()
      set(next_is_output FALSE)
    endif()
  elseif(arg STREQUAL "--")
    set(after_dashes TRUE)
  endif()
endforeach()

execute_process(COMMAND ${cmd} RESULT_VARIABLE rc ERROR_VARIABLE err ECHO_ERROR_VARIABLE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "zoo: compiling the Clad backend failed")
endif()
foreach(pattern "attempted differentiation" "numerical differentiation")
  string(FIND "${err}" "${pattern}" at)
  if(NOT at EQUAL -1)
    if(output)
      file(REMOVE "${output}")
    endif()
    message(FATAL_ERROR "zoo: Clad could not differentiate a call (the '${pattern}' warning above): "
                        "its derivative would silently be zero. Give the callee a visible body or a "
                        "custom derivative (docs/clad.md).")
  endif()
endforeach()
