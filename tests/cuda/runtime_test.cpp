// The CUDA error messages (no GPU needed: the runtime names its errors without a device).
#include <gtest/gtest.h>

#include "epmoe/cuda/runtime.hpp"
#include "expect_error.hpp"

namespace epmoe {
namespace {

using testing::message_of;

std::string message_for(cudaError_t status) {
  return message_of([&] { EPMOE_CUDA_CHECK(status); });
}

// A fault or trap inside a kernel surfaces at a later call and loses the context: the message says so,
// and what to do, beside CUDA's own words and the call that saw it.
TEST(CudaErrors, AKernelFaultSaysTheContextIsLostAndWhatToDo) {
  for (const cudaError_t status :
       {cudaErrorLaunchFailure, cudaErrorIllegalAddress, cudaErrorIllegalInstruction}) {
    const std::string m = message_for(status);
    SCOPED_TRACE(m);
    EXPECT_NE(m.find(cudaGetErrorName(status)), std::string::npos);
    EXPECT_NE(m.find(cudaGetErrorString(status)), std::string::npos);
    EXPECT_NE(m.find(" in status"), std::string::npos);        // the checked expression
    EXPECT_NE(m.find("runtime_test.cpp"), std::string::npos);  // file:line
    EXPECT_NE(m.find("context is lost"), std::string::npos);
    EXPECT_NE(m.find("watchdog"), std::string::npos);
    EXPECT_NE(m.find("compute-sanitizer"), std::string::npos);
  }
}

// An API error (a bad argument) leaves the context usable: no such advice.
TEST(CudaErrors, AnApiErrorIsNotCalledAKernelFault) {
  const std::string m = message_for(cudaErrorInvalidValue);
  EXPECT_NE(m.find(cudaGetErrorName(cudaErrorInvalidValue)), std::string::npos) << m;
  EXPECT_EQ(m.find("context is lost"), std::string::npos) << m;
}

}  // namespace
}  // namespace epmoe
