// Python binding of the drafter core (module samrollout._sam_core).
//
// Arrays cross the boundary without copies (nanobind ndarrays, C-contiguous,
// exact dtypes) and every call that touches automata releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <limits>
#include <cstdint>
#include <string>
#include <vector>
#include <stdexcept>

#include "drafter.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using samrollout::Draft;
using samrollout::DraftPolicy;
using samrollout::Drafter;

namespace {

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using IdArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DraftOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using RowOut = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Reads an iterable of integers into `out` (ints, numpy integers: anything with __index__),
// rejecting values that do not fit T.
template <typename T>
void read_ints(nb::handle values, std::vector<T>& out, const char* what) {
  for (nb::handle item : values) {
    long long value = 0;
    if (!nb::try_cast(item, value)) {
      if (nb::isinstance<nb::int_>(item)) value = std::numeric_limits<long long>::max();  // too large: below
      else throw nb::type_error(what);
    }
    if (value < std::numeric_limits<T>::min() || value > std::numeric_limits<T>::max()) {
      throw std::invalid_argument(std::string(what) + " holds token id " + nb::str(item).c_str() +
                                  ", outside any vocabulary");
    }
    out.push_back(static_cast<T>(value));
  }
}

template <typename T>
nb::list to_list(const T* values, std::size_t count) {
  nb::list out;
  for (std::size_t i = 0; i < count; ++i) out.append(nb::int_(values[i]));
  return out;
}

// The per-row calls' input: request handles and per-row token lists, flattened as Drafter's step takes
// them (the tokens, one offset per row boundary); flat holds one padding entry past its last offset, so a
// step with no tokens still has a valid pointer.
struct RowsIn {
  std::vector<int32_t> flat;
  std::vector<int64_t> handles;
  std::vector<int64_t> offsets{0};
};

RowsIn read_rows(nb::handle requests, nb::handle rows_tokens) {
  RowsIn in;
  read_ints(requests, in.handles, "requests must be a sequence of handles");
  for (nb::handle row : rows_tokens) {
    read_ints(row, in.flat, "each row of tokens must be a sequence of ints");
    in.offsets.push_back(static_cast<int64_t>(in.flat.size()));
  }
  if (in.offsets.size() != in.handles.size() + 1) {
    throw std::invalid_argument("requests and tokens must have the same length");
  }
  in.flat.push_back(0);
  return in;
}

// The engine-shaped step: request handles and per-row token lists in; per row the draft, the
// match length behind it, its source (a DraftSource value, -1: no draft) and its certain prefix
// (Automaton::certain_prefix) out, as four lists.
nb::tuple step_lists(Drafter& d, nb::handle requests, nb::handle rows_tokens, int32_t k) {
  RowsIn in = read_rows(requests, rows_tokens);
  const std::size_t n = in.handles.size();
  const std::size_t width = k > 0 ? static_cast<std::size_t>(k) : 0;
  std::vector<int32_t> drafts(n * width + 1);
  std::vector<int32_t> lengths(n + 1);
  std::vector<int32_t> match_lengths(n + 1);
  std::vector<int32_t> sources(n + 1);
  std::vector<int32_t> certain(n + 1);
  {
    nb::gil_scoped_release release;
    d.step(in.handles.data(), n, in.flat.data(), in.offsets.data(), k, drafts.data(), lengths.data(),
           match_lengths.data(), sources.data(), certain.data());
  }
  nb::list rows;
  for (std::size_t i = 0; i < n; ++i) {
    rows.append(to_list(drafts.data() + i * width, static_cast<std::size_t>(lengths[i])));
  }
  return nb::make_tuple(rows, to_list(match_lengths.data(), n), to_list(sources.data(), n),
                        to_list(certain.data(), n));
}

using CandidateOut = nb::ndarray<int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using SlotOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// step_candidates with per-row token lists in (as step_lists takes them) and arrays out: drafts[rows, sources,
// k], lengths / match_lengths / certain [rows, sources].
void step_candidates(Drafter& d, nb::handle requests, nb::handle rows_tokens, int32_t k, CandidateOut drafts,
                     SlotOut lengths, SlotOut match_lengths, SlotOut certain) {
  RowsIn in = read_rows(requests, rows_tokens);
  const std::size_t n = in.handles.size();
  const auto sources = static_cast<std::size_t>(Drafter::kSources);
  if (drafts.shape(0) != n || drafts.shape(1) != sources || static_cast<int64_t>(drafts.shape(2)) != k) {
    throw std::invalid_argument("drafts must be [rows, sources, k]");
  }
  for (const SlotOut* out : {&lengths, &match_lengths, &certain}) {
    if (out->shape(0) != n || out->shape(1) != sources) {
      throw std::invalid_argument("lengths, match_lengths and certain must be [rows, sources]");
    }
  }
  nb::gil_scoped_release release;
  d.step_candidates(in.handles.data(), n, in.flat.data(), in.offsets.data(), k, drafts.data(), lengths.data(),
                    match_lengths.data(), certain.data());
}

using FlagIn = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using CountIn = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RealIn = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using TableOut = nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// step_goodput with per-row token lists in (as step_lists takes them) and arrays for the rest.
void step_goodput(Drafter& d, nb::handle requests, nb::handle rows_tokens, int32_t k, FlagIn greedy, CountIn limits,
                  RealIn weights, RealIn seconds, DraftOut drafts, RowOut lengths, RowOut match_lengths,
                  RowOut sources, RowOut certain) {
  RowsIn in = read_rows(requests, rows_tokens);
  const std::size_t n = in.handles.size();
  if (greedy.shape(0) != n || limits.shape(0) != n || weights.shape(0) != n) {
    throw std::invalid_argument("greedy, limits and weights must have one entry per row");
  }
  if (drafts.shape(0) != n || static_cast<int64_t>(drafts.shape(1)) != k) {
    throw std::invalid_argument("drafts must be [rows, k]");
  }
  for (const RowOut* out : {&lengths, &match_lengths, &sources, &certain}) {
    if (out->shape(0) != n) throw std::invalid_argument("lengths, match_lengths, sources and certain must be [rows]");
  }
  nb::gil_scoped_release release;
  d.step_goodput(in.handles.data(), n, in.flat.data(), in.offsets.data(), k, greedy.data(), limits.data(),
                 weights.data(), seconds.data(), seconds.shape(0), drafts.data(), lengths.data(),
                 match_lengths.data(), sources.data(), certain.data());
}

}  // namespace

NB_MODULE(_sam_core, m) {
  m.doc() = "Native suffix-automaton drafter core of samrollout.";
  m.attr("MAX_DRAFT_TOKENS") = Drafter::kMaxDraftTokens;
  m.attr("MAX_FALLBACK_HOPS") = samrollout::Automaton::kMaxFallbackHops;
  m.attr("SOURCES") = Drafter::kSources;
  m.attr("MATCH_BUCKETS") = samrollout::kMatchBuckets;
  m.def("match_bucket", &samrollout::match_bucket, "match_length"_a,
        "The half-octave bucket of a match length (0: none; 1, 2, 3, 4-5, 6-7, 8-11, ...).");
  m.def(
      "allocate",
      [](nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu> values, RealIn weights,
         RealIn seconds, RowOut lengths) {
        const std::size_t rows = values.shape(0);
        if (weights.shape(0) != rows || lengths.shape(0) != rows || seconds.shape(0) == 0) {
          throw std::invalid_argument("weights and lengths need one entry per row, seconds at least one");
        }
        nb::gil_scoped_release release;
        samrollout::allocate(values.data(), rows, static_cast<int32_t>(values.shape(1)), weights.data(),
                             seconds.data(), seconds.shape(0), lengths.data());
      },
      "values"_a.noconvert(), "weights"_a.noconvert(), "seconds"_a.noconvert(), "lengths"_a.noconvert(),
      "The adaptive policy's allocation alone (goodput.hpp): each row's draft length maximising weighted "
      "expected tokens per second, from values[rows, depth] (non-increasing per row), weights[rows] and "
      "seconds[n draft tokens]; written into lengths[rows].");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  nb::enum_<samrollout::Occurrence>(m, "Occurrence", "Which earlier occurrence of the matched suffix drafts.")
      .value("first", samrollout::Occurrence::kFirst)
      .value("recent", samrollout::Occurrence::kRecent)
      .value("frequent", samrollout::Occurrence::kFrequent);
  nb::enum_<samrollout::Source>(m, "Source", "Which automata a request in a group drafts from.")
      .value("own", samrollout::Source::kOwn)
      .value("group", samrollout::Source::kGroup)
      .value("both", samrollout::Source::kBoth);
  nb::enum_<samrollout::Proposals>(m, "Proposals", "What the adaptive policy's candidates are.")
      .value("copies", samrollout::Proposals::kCopies)
      .value("counted", samrollout::Proposals::kCounted);
  nb::enum_<samrollout::DraftSource>(m, "DraftSource", "Where one draft came from.")
      .value("own", samrollout::DraftSource::kOwn)
      .value("group", samrollout::DraftSource::kGroup)
      .value("global", samrollout::DraftSource::kGlobal);

  // One def_rw line per knob: samrollout.drafter.DraftPolicy sets them by name.
  nb::class_<DraftPolicy>(m, "DraftPolicy", "The native draft policy (service/csrc/drafter.hpp); validate() checks it.")
      .def(nb::init<>())
      .def_rw("vocab_size", &DraftPolicy::vocab_size)
      .def_rw("min_match_length", &DraftPolicy::min_match_length)
      .def_rw("match_scale", &DraftPolicy::match_scale)
      .def_rw("occurrence", &DraftPolicy::occurrence)
      .def_rw("min_probability", &DraftPolicy::min_probability)
      .def_rw("source", &DraftPolicy::source)
      .def_rw("group_margin", &DraftPolicy::group_margin)
      .def_rw("max_request_tokens", &DraftPolicy::max_request_tokens)
      .def_rw("max_group_tokens", &DraftPolicy::max_group_tokens)
      .def_rw("max_global_tokens", &DraftPolicy::max_global_tokens)
      .def_rw("global_margin", &DraftPolicy::global_margin)
      .def_rw("proposals", &DraftPolicy::proposals)
      .def("validate", &DraftPolicy::validate, "Raise ValueError naming the first field out of its range.");

  nb::class_<Draft>(m, "Draft", "One request's draft: its tokens, the match behind them and their source.")
      .def_ro("tokens", &Draft::tokens)
      .def_ro("match_length", &Draft::match_length)
      .def_ro("source", &Draft::source)
      .def_ro("certain", &Draft::certain);

  nb::class_<samrollout::CountedDraft>(m, "CountedDraft", "One request's counted paths and their evidence.")
      .def_ro("main", &samrollout::CountedDraft::main)
      .def_ro("second", &samrollout::CountedDraft::second)
      .def_ro("match_length", &samrollout::CountedDraft::match_length)
      .def_ro("main_counts", &samrollout::CountedDraft::main_counts)
      .def_ro("main_totals", &samrollout::CountedDraft::main_totals)
      .def_ro("second_counts", &samrollout::CountedDraft::second_counts)
      .def_ro("second_totals", &samrollout::CountedDraft::second_totals);

  nb::class_<Drafter>(m, "Core")
      .def(nb::init<const DraftPolicy&>(), "policy"_a)
      .def(
          "add_request",
          [](Drafter& d, int64_t request, TokenArray prompt, int64_t group) {
            nb::gil_scoped_release release;
            return d.add_request(request, prompt.data(), prompt.shape(0), group);
          },
          "request"_a, "prompt"_a.noconvert(), "group"_a)
      .def(
          "append",
          [](Drafter& d, int64_t request, TokenArray tokens) {
            nb::gil_scoped_release release;
            d.append(request, tokens.data(), tokens.shape(0));
          },
          "request"_a, "tokens"_a.noconvert())
      .def("propose", &Drafter::propose, "request"_a, "k"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("counted", &Drafter::counted, "request"_a, "k"_a, nb::call_guard<nb::gil_scoped_release>(),
           "The request's counted paths (main and second) of up to k tokens, with each token's counts.")
      .def(
          "step",
          [](Drafter& d, IdArray requests, TokenArray tokens, IdArray offsets, int32_t k, DraftOut drafts,
             RowOut lengths, RowOut match_lengths, RowOut sources, RowOut certain) {
            const std::size_t rows = requests.shape(0);
            if (offsets.shape(0) != rows + 1) {
              throw std::invalid_argument("offsets must have one entry more than requests");
            }
            if (offsets.data()[rows] != static_cast<int64_t>(tokens.shape(0))) {
              throw std::invalid_argument("offsets[-1] must equal the number of tokens");
            }
            if (drafts.shape(0) < rows || static_cast<int64_t>(drafts.shape(1)) != k || lengths.shape(0) < rows ||
                match_lengths.shape(0) < rows || sources.shape(0) < rows || certain.shape(0) < rows) {
              throw std::invalid_argument("output arrays must be [rows, k] and [rows]");
            }
            nb::gil_scoped_release release;
            d.step(requests.data(), rows, tokens.data(), offsets.data(), k, drafts.data(), lengths.data(),
                   match_lengths.data(), sources.data(), certain.data());
          },
          "requests"_a.noconvert(), "tokens"_a.noconvert(), "offsets"_a.noconvert(), "k"_a,
          "drafts"_a.noconvert(), "lengths"_a.noconvert(), "match_lengths"_a.noconvert(), "sources"_a.noconvert(),
          "certain"_a.noconvert())
      .def("step_candidates", &step_candidates, "requests"_a, "tokens"_a, "k"_a, "drafts"_a.noconvert(),
           "lengths"_a.noconvert(), "match_lengths"_a.noconvert(), "certain"_a.noconvert(),
           "Append each row's tokens (lists, as step_lists takes them); write every source's draft for each row "
           "into drafts[row, source] (a DraftSource value; padded with -1) and its length, match and certain "
           "prefix into [row, source] (length 0: that source has nothing).")
      .def("step_goodput", &step_goodput, "requests"_a, "tokens"_a, "k"_a, "greedy"_a.noconvert(),
           "limits"_a.noconvert(), "weights"_a.noconvert(), "seconds"_a.noconvert(), "drafts"_a.noconvert(),
           "lengths"_a.noconvert(), "match_lengths"_a.noconvert(), "sources"_a.noconvert(),
           "certain"_a.noconvert(),
           "One step of the adaptive policy (goodput.hpp): append each row's tokens, score its last candidates, "
           "choose each row's source and draft length; writes drafts[rows, k] (padded with -1) and per row its "
           "length, match, source (-1: none) and certain prefix.")
      .def(
          "acceptance_table",
          [](const Drafter& d, TableOut seen, TableOut accepted) {
            const auto sources = static_cast<std::size_t>(Drafter::kSources);
            const auto buckets = static_cast<std::size_t>(samrollout::kMatchBuckets);
            if (seen.shape(0) != sources || seen.shape(1) != buckets || accepted.shape(0) != sources ||
                accepted.shape(1) != buckets) {
              throw std::invalid_argument("seen and accepted must be [sources, match buckets]");
            }
            d.acceptance_table(seen.data(), accepted.data());
          },
          "seen"_a.noconvert(), "accepted"_a.noconvert(),
          "The adaptive policy's first-token observations and acceptances per [source, match bucket].")
      .def("step_lists", &step_lists, "requests"_a, "tokens"_a, "k"_a,
           "Append each row's tokens; return (drafts, match_lengths, sources, certain) as lists, one entry per "
           "row (drafts in vLLM's proposer shape; a source is a DraftSource value, -1 where a row drafted "
           "nothing; certain: leading draft tokens every earlier occurrence continued with).")
      .def(
          "remove_request",
          [](Drafter& d, int64_t request) {
            nb::gil_scoped_release release;
            d.remove_request(request);
          },
          "request"_a)
      .def(
          "add_to_group",
          [](Drafter& d, int64_t group, TokenArray tokens) {
            nb::gil_scoped_release release;
            return d.add_to_group(group, tokens.data(), tokens.shape(0));
          },
          "group"_a, "tokens"_a.noconvert())
      .def(
          "add_to_global",
          [](Drafter& d, TokenArray tokens) {
            nb::gil_scoped_release release;
            return d.add_to_global(tokens.data(), tokens.shape(0));
          },
          "tokens"_a.noconvert())
      .def(
          "response",
          [](const Drafter& d, int64_t request) {
            std::vector<int32_t> tokens;
            {
              nb::gil_scoped_release release;
              tokens = d.response(request);
            }
            auto* data = new std::vector<int32_t>(std::move(tokens));
            nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
            return nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(data->data(), {data->size()}, owner);
          },
          "request"_a)
      .def("has_request", &Drafter::has_request, "request"_a)
      .def(
          "info",
          [](const Drafter& d, int64_t request) {
            const samrollout::RequestInfo i = d.info(request);
            nb::dict out;
            out["num_tokens"] = i.num_tokens;
            out["match_length"] = i.match_length;
            out["own_overflow"] = i.own_overflow;
            out["group_overflow"] = i.group_overflow;
            out["group"] = i.group;
            return out;
          },
          "request"_a)
      .def_prop_ro("num_requests", &Drafter::num_requests)
      .def_prop_ro("num_groups", &Drafter::num_groups)
      .def_prop_ro("global_tokens", &Drafter::global_tokens)
      .def("memory_bytes", &Drafter::memory_bytes);
}
