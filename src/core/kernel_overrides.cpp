// kernel_overrides.cpp — the process's KernelOverrides and `padmoe bench --variant`'s parser.
#include "core/kernel_overrides.hpp"

#include <cstdlib>

namespace padmoe {
namespace detail {

KernelOverrides& kernel_overrides() {
  static KernelOverrides o;
  return o;
}

namespace {

bool parse_bool(const std::string& v, std::optional<bool>* out) {
  if (v == "on" || v == "1") *out = true;
  else if (v == "off" || v == "0") *out = false;
  else if (v == "auto") out->reset();
  else return false;
  return true;
}

template <typename E>
struct Name {
  const char* name;
  E value;
};

template <typename E, size_t N>
bool parse_enum(const std::string& v, const Name<E> (&names)[N], std::optional<E>* out) {
  if (v == "auto") {
    out->reset();
    return true;
  }
  for (const Name<E>& n : names) {
    if (v == n.name) {
      *out = n.value;
      return true;
    }
  }
  return false;
}

bool parse_int(const std::string& v, int lo, int* out) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > (1 << 30)) return false;
  *out = static_cast<int>(n);
  return true;
}

using policy::ChunkRowsForm;
using policy::PlanCounts;
using policy::PlanMatch;
using policy::PlanPath;
using policy::ReduceDotsKernel;
using policy::ReduceKernel;
using policy::RowDotsKernel;
using policy::SpreadKernel;

const Name<PlanPath> kPlanPaths[] = {
    {"small", PlanPath::kSmall}, {"fused", PlanPath::kFused}, {"split", PlanPath::kSplit}};
const Name<PlanMatch> kPlanMatches[] = {{"match", PlanMatch::kMatchAny}, {"ballot", PlanMatch::kBallot}};
const Name<PlanCounts> kPlanCounts[] = {{"ints", PlanCounts::kInts}, {"pairs", PlanCounts::kPairs}};
const Name<SpreadKernel> kSpreads[] = {{"block", SpreadKernel::kBlock}, {"warp", SpreadKernel::kWarp}};
const Name<ReduceKernel> kReduces[] = {{"block", ReduceKernel::kBlock},
                                       {"block-wide", ReduceKernel::kBlockWide},
                                       {"token-block", ReduceKernel::kTokenBlock},
                                       {"token-block-two", ReduceKernel::kTokenBlockTwoUnits}};
const Name<ReduceDotsKernel> kReduceDots[] = {{"block", ReduceDotsKernel::kBlock},
                                              {"block-wide", ReduceDotsKernel::kBlockWide},
                                              {"token-warp", ReduceDotsKernel::kTokenWarp},
                                              {"token-block", ReduceDotsKernel::kTokenBlock},
                                              {"token-block-two", ReduceDotsKernel::kTokenBlockTwoUnits}};
const Name<RowDotsKernel> kRowDots[] = {{"warp", RowDotsKernel::kAssignmentWarp},
                                        {"token-block", RowDotsKernel::kTokenBlock}};
const Name<ChunkRowsForm> kChunkForms[] = {
    {"flat", ChunkRowsForm::kFlat}, {"rowwise", ChunkRowsForm::kRowwise}, {"one-scan", ChunkRowsForm::kOneScan}};

}  // namespace

std::string variant_keys() {
  return "plan=auto|small|fused|split, plan-blocks=N (0: no cap), plan-match=auto|match|ballot, "
         "plan-counts=auto|ints|pairs, spread=auto|block|warp, "
         "reduce=auto|block|block-wide|token-block|token-block-two, "
         "reduce-dots=auto|block|block-wide|token-warp|token-block|token-block-two, row-dots=auto|warp|token-block, "
         "slice-blocks=N (-1: the policy's), dest-search=auto|on|off, l2-prefetch=auto|on|off, pdl=auto|on|off, "
         "mask-one-launch=auto|on|off, chunk-map=auto|on|off, chunk-rows=auto|on|off, "
         "chunk-form=auto|flat|rowwise|one-scan, avx2=auto|on|off";
}

bool set_kernel_variant(KernelOverrides& o, const std::string& key, const std::string& value, std::string* error) {
  bool ok = false;
  bool known = true;
  if (key == "plan") ok = parse_enum(value, kPlanPaths, &o.plan_path);
  else if (key == "plan-blocks") ok = parse_int(value, 0, &o.plan_fused_blocks);
  else if (key == "plan-match") ok = parse_enum(value, kPlanMatches, &o.plan_match);
  else if (key == "plan-counts") ok = parse_enum(value, kPlanCounts, &o.plan_counts);
  else if (key == "spread") ok = parse_enum(value, kSpreads, &o.spread);
  else if (key == "reduce") ok = parse_enum(value, kReduces, &o.reduce);
  else if (key == "reduce-dots") ok = parse_enum(value, kReduceDots, &o.reduce_dots);
  else if (key == "row-dots") ok = parse_enum(value, kRowDots, &o.row_dots);
  else if (key == "slice-blocks") ok = parse_int(value, -1, &o.reduce_slice_blocks);
  else if (key == "dest-search") ok = parse_bool(value, &o.dest_search);
  else if (key == "l2-prefetch") ok = parse_bool(value, &o.l2_prefetch);
  else if (key == "pdl") ok = parse_bool(value, &o.pdl);
  else if (key == "mask-one-launch") ok = parse_bool(value, &o.mask_one_launch);
  else if (key == "chunk-map") ok = parse_bool(value, &o.chunk_map_fused);
  else if (key == "chunk-rows") ok = parse_bool(value, &o.chunk_rows);
  else if (key == "chunk-form") ok = parse_enum(value, kChunkForms, &o.chunk_rows_form);
  else if (key == "avx2") ok = parse_bool(value, &o.cpu_avx2);
  else known = false;
  if (!ok && error != nullptr) {
    *error = known ? "--variant " + key + "=" + value + ": unknown value"
                   : "--variant " + key + ": unknown key (" + variant_keys() + ")";
  }
  return ok;
}

}  // namespace detail
}  // namespace padmoe
