// The whole public API.
#pragma once

#include "epmoe/config.hpp"
#include "epmoe/dispatch.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/error.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/numerics.hpp"
#include "epmoe/quant.hpp"
#include "epmoe/router.hpp"
#include "epmoe/runner.hpp"
#include "epmoe/tensor.hpp"
#include "epmoe/weights.hpp"
