// padmoe/padmoe.hpp — everything public: tensor views, errors, the routing
// ops, the shared index math and the tile planner. No CUDA, Python or torch
// headers are pulled in.
#pragma once

#include "padmoe/config.hpp"
#include "padmoe/error.hpp"
#include "padmoe/index_math.hpp"
#include "padmoe/numeric.hpp"
#include "padmoe/ops.hpp"
#include "padmoe/tensor.hpp"
#include "padmoe/tiling.hpp"
