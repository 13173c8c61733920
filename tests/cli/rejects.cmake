# Runs the CLI with one set of arguments (ARGS, ';'-separated) and requires exit code 2 and a
# message matching EXPECT on stderr, quickly: sizes the library rejects must be rejected before
# anything is allocated (2^31 assignments would otherwise allocate 23.7 GB and be killed).
separate_arguments(_args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${CLI}" ${_args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(NOT rc EQUAL 2)
  message(FATAL_ERROR "padmoe ${ARGS}: exit code ${rc}, expected 2\nstdout: ${out}\nstderr: ${err}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "padmoe ${ARGS}: stderr does not match '${EXPECT}':\n${err}")
endif()
