// The ragged exchange (vjpmpi.ragged_alltoall and the v-collectives built on it), on
// plain host pointers: every rank's offsets and sizes gathered to every rank (one
// MPI_Allgather), checked there alike (so a bad count is the same error on every rank),
// then one message per non-empty slice (MPI_Isend / MPI_Irecv on a duplicate of the
// communicator, rows as bytes).
//
// Forward: rank j sends rows [in_off, in_off + size) of its operand, for each slice i
// (to rank i / per), into the receiver's output at the slice's output offset: the one
// the sender names (form kRagged, jax.lax.ragged_all_to_all), or the next free row of
// its group's segment, in source-rank order (the packed forms, the v-collectives).
// Reverse (the transpose): each slice travels back, from the output-shaped cotangent
// into the operand-shaped accumulator (added: slices of the operand may overlap), and
// the cotangent's received rows are zeroed.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
#include "ragged.h"

namespace vjpmpi {

const char* RaggedName(int form) {
  static const char* names[] = {"ragged_alltoall", "alltoallv", "allgatherv", "gatherv",
                                "scatterv"};
  return form >= 0 && form <= 4 ? names[form] : "ragged_alltoall";
}

// Every rank's part of one call: [rows of the operand, rows of the output, then
// input_offsets, send_sizes, output_offsets, recv_sizes (n each)].
struct RaggedPlan {
  int size = 1, rank = 0, n = 0, per = 1, groups = 1, form = kRagged;
  size_t stride = 0;  // int64 words per rank in `all` (its part, then its inline data)
  // (each thread's calls reuse the same vectors: no allocation per call)
  std::vector<int64_t>& all = Reused(0);
  std::vector<int64_t>& src = Reused(1);  // (sender j, slice i) -> its first row in j's operand, j * n + i
  std::vector<int64_t>& dst = Reused(2);  // (sender j, slice i) -> its first row in the receiver's output

  static std::vector<int64_t>& Reused(int k) {
    static thread_local std::vector<int64_t> v[4];
    return v[k];
  }

  int64_t* of(int j) { return all.data() + static_cast<size_t>(j) * stride; }
  // (after its part: whether rank j's rows for the other ranks are inline, then them)
  bool inlined(int j) { return of(j)[2 + 4 * n] != 0; }
  const unsigned char* inline_data(int j) {
    return reinterpret_cast<const unsigned char*>(of(j) + 3 + 4 * n);
  }
  int64_t rows_in(int j) { return of(j)[0]; }
  int64_t rows_out(int j) { return of(j)[1]; }
  int64_t in_off(int j, int i) { return of(j)[2 + i]; }
  int64_t count(int j, int i) { return of(j)[2 + n + i]; }
  int64_t out_off(int j, int i) { return of(j)[2 + 2 * n + i]; }
  int64_t recv(int j, int i) { return of(j)[2 + 3 * n + i]; }
};

// The arguments' names in the errors of each form.
std::string RaggedArg(int form, const char* what, int j, int i, int per, int root) {
  std::string who = "rank " + std::to_string(j) + "'s ";
  std::string at = "[" + std::to_string(i) + "]";
  std::string w = what;
  if (form == kRagged) return who + w + at;
  if (form == kScatterv) return "the root's (rank " + std::to_string(root) + ") counts[" +
                                std::to_string(i / per) + "]";
  if (form == kAlltoallv) return who + "send_counts[" + std::to_string(i / per) + "]";
  return who + "count";
}

// Checks every rank's part of the call alike (the same text on every rank, or none) and
// places each slice in its sender's operand and its receiver's output. With `groups`
// > 1 (a batch folded into one call: slice s of a pair belongs to group s / (per /
// groups)), the operand and the output are `groups` segments of equal rows, and the
// offsets count from the start of their group's segment.
std::string PlanRagged(RaggedPlan& p, int root) {
  const char* op = RaggedName(p.form);
  auto fail = [&](const std::string& why) {
    return std::string("vjpmpi.") + op + ": " + why + " (every rank of the call stops here)";
  };
  auto arg = [&](const char* what, int j, int i) {
    return RaggedArg(p.form, what, j, i, p.per, root);
  };
  p.src.assign(static_cast<size_t>(p.size) * p.n, 0);
  p.dst.assign(static_cast<size_t>(p.size) * p.n, 0);
  const int per_group = p.per / p.groups;
  auto group = [&](int i) { return (i % p.per) / per_group; };
  for (int j = 0; j < p.size; ++j) {
    const int64_t rows = p.rows_in(j) / p.groups;
    for (int i = 0; i < p.n; ++i) {
      int64_t a = p.in_off(j, i), k = p.count(j, i);
      if (k < 0) return fail(arg("send_sizes", j, i) + "=" + std::to_string(k) + " is negative");
      if (a < 0) return fail(arg("input_offsets", j, i) + "=" + std::to_string(a) + " is negative");
      p.src[static_cast<size_t>(j) * p.n + i] = group(i) * rows + a;
      if (a + k > rows) {
        if (p.form == kRagged) {
          return fail("rank " + std::to_string(j) + "'s slice " + std::to_string(i) +
                      " (input_offsets[" + std::to_string(i) + "]=" + std::to_string(a) +
                      ", send_sizes[" + std::to_string(i) + "]=" + std::to_string(k) +
                      ") ends past its operand's " + std::to_string(rows) + " rows");
        }
        const std::string of_x = " rows of " + (p.form == kScatterv ? std::string("the root's")
                                                 : "rank " + std::to_string(j) + "'s") + " x";
        if (a == 0) {
          return fail(arg("", j, i) + "=" + std::to_string(k) + " is more than the " +
                      std::to_string(rows) + of_x);
        }
        // Blocks back to back: a count that fits alone, past the rows with those before it.
        // The message names the running sum (and its terms: the counts before it of its
        // group, when they add up to its offset).
        const std::string name = p.form == kScatterv
                                      ? "the root's (rank " + std::to_string(root) + ") counts"
                                      : "rank " + std::to_string(j) + "'s send_counts";
        const std::string label = p.form == kScatterv ? "counts" : "send_counts";
        std::string terms;
        int64_t total = 0;
        for (int q = 0; q <= i; ++q) {
          if (group(q) != group(i)) continue;
          total += p.count(j, q);
          terms += (terms.empty() ? "" : " + ") + std::to_string(p.count(j, q));
        }
        return fail(name + " sum to " + std::to_string(a + k) + " (" + label + "[0.." +
                    std::to_string(i / p.per) + "]" + (total == a + k ? " = " + terms : "") +
                    "), more than the " + std::to_string(rows) + of_x);
      }
    }
  }
  if (p.form == kRagged) {
    for (int j = 0; j < p.size; ++j) {
      for (int i = 0; i < p.n; ++i) {
        int r = i / p.per, s = i % p.per;
        int64_t k = p.count(j, i), b = p.out_off(j, i), want = p.recv(r, j * p.per + s);
        if (want != k) {
          return fail("rank " + std::to_string(r) + "'s recv_sizes[" + std::to_string(j * p.per + s) +
                      "]=" + std::to_string(want) + " differs from what rank " + std::to_string(j) +
                      " sends it, send_sizes[" + std::to_string(i) + "]=" + std::to_string(k));
        }
        if (b < 0) return fail(arg("output_offsets", j, i) + "=" + std::to_string(b) + " is negative");
        const int64_t rows = p.rows_out(r) / p.groups;
        if (b + k > rows) {
          return fail("rank " + std::to_string(j) + "'s slice " + std::to_string(i) + " to rank " +
                      std::to_string(r) + " (output_offsets[" + std::to_string(i) + "]=" +
                      std::to_string(b) + ", send_sizes[" + std::to_string(i) + "]=" +
                      std::to_string(k) + ") ends past rank " + std::to_string(r) + "'s output of " +
                      std::to_string(rows) + " rows");
        }
        p.dst[static_cast<size_t>(j) * p.n + i] = group(i) * rows + b;
      }
    }
    // No two slices may write the same rows of one output (the transpose needs each
    // received row's one source).
    for (int r = 0; r < p.size; ++r) {
      static thread_local std::vector<std::pair<std::pair<int64_t, int64_t>, std::pair<int, int>>> in;
      in.clear();
      for (int j = 0; j < p.size; ++j) {
        for (int s = 0; s < p.per; ++s) {
          int i = r * p.per + s;
          if (p.count(j, i) > 0) in.push_back({{p.dst[static_cast<size_t>(j) * p.n + i], p.count(j, i)}, {j, i}});
        }
      }
      std::sort(in.begin(), in.end());
      for (size_t q = 1; q < in.size(); ++q) {
        if (in[q - 1].first.first + in[q - 1].first.second > in[q].first.first) {
          auto row = [](const std::pair<int64_t, int64_t>& x) {
            return std::to_string(x.first) + ".." + std::to_string(x.first + x.second - 1);
          };
          return fail("rank " + std::to_string(r) + "'s output receives overlapping slices: rows " +
                      row(in[q - 1].first) + " from rank " + std::to_string(in[q - 1].second.first) +
                      " (its slice " + std::to_string(in[q - 1].second.second) + ") and rows " +
                      row(in[q].first) + " from rank " + std::to_string(in[q].second.first) +
                      " (its slice " + std::to_string(in[q].second.second) + ")");
        }
      }
    }
    return {};
  }
  // Packed: each group's segment of the receiver's output, filled in source-rank order.
  for (int r = 0; r < p.size; ++r) {
    const int64_t segment = p.rows_out(r) / p.groups;
    for (int g = 0; g < p.groups; ++g) {
      int64_t next = 0;
      for (int j = 0; j < p.size; ++j) {
        for (int s = g * per_group; s < (g + 1) * per_group; ++s) {
          int i = r * p.per + s;
          p.dst[static_cast<size_t>(j) * p.n + i] = g * segment + next;
          next += p.count(j, i);
        }
      }
      if (next > segment) {
        return fail("rank " + std::to_string(r) + " receives " + std::to_string(next) +
                    " rows in all, more than its capacity=" + std::to_string(segment));
      }
    }
  }
  return {};
}

// The bytes of rows a rank may send to the others inside the gathered parts (the
// forward exchange's small messages then take no round of their own): the same on
// every rank of a communicator (MPI_Allgather's parts have one size).
size_t InlineBytes(int size) { return size > 32 ? 0 : 4096 / static_cast<size_t>(size) / 8 * 8; }

ProcessPeers::ProcessPeers(const Call& call) : c(call) {
  MPI_Comm_size(c.comm, &size);
  MPI_Comm_rank(c.comm, &rank);
  room = 0;
}

std::string ProcessPeers::Gather(const int64_t* part, size_t stride, int64_t* all) {
  const char* op = c.op;
  auto e = Check(MPI_Allgather(part, static_cast<int>(stride), MPI_INT64_T, all,
                               static_cast<int>(stride), MPI_INT64_T, c.comm),
                 op, "MPI_Allgather");
  if (!e.empty()) return e;
  // (its messages apart from the program's own point-to-point ones; made on every rank
  // alike at the first call, MPI_Comm_dup being a collective, then kept)
  return DerivedComm(c.comm, Derived::kDuplicate, op, &dup);
}

std::string ProcessPeers::Send(const void* buf, size_t bytes, int peer, int) {
  MPI_Request r;
  int rc = VJPMPI_BY_COUNT(bytes, MPI_Isend, buf, n, MPI_BYTE, peer, 0, dup, &r);
  if (rc == MPI_SUCCESS) reqs.push_back(r);
  return Check(rc, c.op, "MPI_Isend");
}

std::string ProcessPeers::Recv(void* buf, size_t bytes, int peer, int) {
  MPI_Request r;
  int rc = VJPMPI_BY_COUNT(bytes, MPI_Irecv, buf, n, MPI_BYTE, peer, 0, dup, &r);
  if (rc == MPI_SUCCESS) reqs.push_back(r);
  return Check(rc, c.op, "MPI_Irecv");
}

std::string ProcessPeers::Finish() {
  if (reqs.empty()) return {};
  std::string w = Check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(),
                                    MPI_STATUSES_IGNORE),
                        c.op, "MPI_Waitall");
  reqs.clear();
  return w;
}

std::string Ragged(const Call& c, int form, int groups, bool reverse, size_t row_bytes,
                   const std::vector<int64_t>& mine, int n, const void* in, void* out,
                   void* masked, int32_t* received) {
  ProcessPeers peers(c);
  peers.room = reverse ? 0 : InlineBytes(peers.size);
  return RaggedWith(peers, c, form, groups, reverse, row_bytes, mine, n, in, out, masked,
                    received);
}

// One ragged call. `in`: the operand (forward) or the output-shaped cotangent (reverse);
// `out`: the output (forward, holding the template's rows already) or the accumulator
// (reverse, holding its initial value); `masked`: (reverse) the cotangent with its
// received rows zeroed, holding the cotangent already (it may be `in`); `received`
// (forward): the rows received per slice, int32 in receiver order (source j's slice s
// at j * per + s). `mine`: this rank's part, 2 + 4n values as RaggedPlan holds them.
std::string RaggedWith(RaggedPeers& peers, const Call& c, int form, int groups, bool reverse,
                       size_t row_bytes, const std::vector<int64_t>& mine, int n, const void* in,
                       void* out, void* masked, int32_t* received) {
  RaggedPlan p;
  p.form = form;
  p.groups = groups < 1 ? 1 : groups;
  p.n = n;
  p.size = peers.size;
  p.rank = peers.rank;
  p.per = p.size > 0 ? n / p.size : 1;
  const char* op = RaggedName(form);
  const int me = p.rank;
  auto at = [row_bytes](const void* base, int64_t row) {
    return static_cast<unsigned char*>(const_cast<void*>(base)) + static_cast<size_t>(row) * row_bytes;
  };
  // This rank's part, and (forward) its rows for the other ranks where they fit: slices
  // in order, each checked here as PlanRagged will check it on every rank.
  const size_t room = reverse ? 0 : peers.room;
  p.stride = mine.size() + 1 + room / 8;
  std::vector<int64_t>& part = RaggedPlan::Reused(3);
  part.assign(mine.begin(), mine.end());
  part.resize(p.stride, 0);
  if (room) {
    const int per_group = p.per / p.groups;
    const int64_t rows = mine[0] / p.groups;
    size_t bytes = 0;
    bool fits = true;
    for (int i = 0; i < n && fits; ++i) {
      int64_t a = mine[2 + i], k = mine[2 + n + i];
      if (k < 0 || a < 0 || a + k > rows) fits = false;
      else if (i / p.per != me) bytes += static_cast<size_t>(k) * row_bytes;
      if (bytes > room) fits = false;
    }
    if (fits) {
      part[mine.size()] = 1;
      unsigned char* to = reinterpret_cast<unsigned char*>(part.data() + mine.size() + 1);
      for (int i = 0; i < n; ++i) {
        int64_t k = mine[2 + n + i];
        if (i / p.per == me || k == 0) continue;
        int64_t row = ((i % p.per) / per_group) * rows + mine[2 + i];
        std::memcpy(to, at(in, row), static_cast<size_t>(k) * row_bytes);
        to += static_cast<size_t>(k) * row_bytes;
      }
    }
  }
  p.all.resize(static_cast<size_t>(p.size) * p.stride);
  auto e = peers.Gather(part.data(), p.stride, p.all.data());
  if (!e.empty()) return e;
  e = PlanRagged(p, c.root);
  if (!e.empty()) return e;
  (void)op;
  // (sends before receives: a receive from a device of this process may wait for its
  // sender, which must not be waiting for this one's send)
  auto post = [&](bool send, void* buf, int64_t rows, int peer, int tag) {
    size_t bytes = static_cast<size_t>(rows) * row_bytes;
    return send ? peers.Send(buf, bytes, peer, tag) : peers.Recv(buf, bytes, peer, tag);
  };
  auto wait = [&]() { return peers.Finish(); };
  if (!reverse) {
    for (int i = 0; i < n && e.empty(); ++i) {  // what it sends
      int r = i / p.per;
      int64_t k = p.count(me, i);
      if (k == 0) continue;
      if (r == me) {
        std::memmove(at(out, p.dst[static_cast<size_t>(me) * n + i]), at(in, p.src[static_cast<size_t>(me) * n + i]),
                     static_cast<size_t>(k) * row_bytes);
      } else if (!p.inlined(me)) {
        e = post(true, at(in, p.src[static_cast<size_t>(me) * n + i]), k, r, i);
      }
    }
    for (int j = 0; j < p.size && e.empty(); ++j) {  // what this rank receives, from each j
      const unsigned char* from = j != me && p.inlined(j) ? p.inline_data(j) : nullptr;
      for (int i = 0; i < n && e.empty(); ++i) {  // (j's slices in order: its inline data's)
        int r = i / p.per;
        int64_t k = p.count(j, i);
        if (r != me) {
          if (from && r != j) from += static_cast<size_t>(k) * row_bytes;
          continue;
        }
        if (received) received[j * p.per + i % p.per] = static_cast<int32_t>(k);
        if (k == 0 || j == me) continue;
        void* to = at(out, p.dst[static_cast<size_t>(j) * n + i]);
        if (from) {
          std::memcpy(to, from, static_cast<size_t>(k) * row_bytes);
          from += static_cast<size_t>(k) * row_bytes;
        } else {
          e = post(false, to, k, j, i);
        }
      }
    }
    std::string w = wait();
    return e.empty() ? w : e;
  }
  // Reverse: this rank's forward slices come back into scratch, then are added in.
  std::vector<int64_t> start(n, 0);
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    start[i] = total;
    total += p.count(me, i);
  }
  static thread_local std::vector<unsigned char> scratch;
  scratch.resize(static_cast<size_t>(total) * row_bytes);
  for (int j = 0; j < p.size && e.empty(); ++j) {  // what it sends back, to each j
    if (j == me) continue;
    for (int s = 0; s < p.per && e.empty(); ++s) {
      int i = me * p.per + s;
      int64_t k = p.count(j, i);
      if (k > 0) e = post(true, at(in, p.dst[static_cast<size_t>(j) * n + i]), k, j, i);
    }
  }
  for (int i = 0; i < n && e.empty(); ++i) {  // what comes back to this rank
    int r = i / p.per;
    int64_t k = p.count(me, i);
    if (k == 0) continue;
    if (r == me) {
      std::memcpy(at(scratch.data(), start[i]), at(in, p.dst[static_cast<size_t>(me) * n + i]),
                  static_cast<size_t>(k) * row_bytes);
    } else {
      e = post(false, at(scratch.data(), start[i]), k, r, i);
    }
  }
  std::string w = wait();
  if (!e.empty() || !w.empty()) return e.empty() ? w : e;
  const size_t elems_per_row = row_bytes / ByteSize(c.kind);
  MPI_Datatype t = Datatype(c.kind);
  MPI_Op sum = Operation(Red::kSum, c.kind);
  for (int i = 0; i < n; ++i) {
    size_t left = static_cast<size_t>(p.count(me, i)) * elems_per_row;
    unsigned char* src = at(scratch.data(), start[i]);
    unsigned char* dst = at(out, p.src[static_cast<size_t>(me) * n + i]);
    while (left > 0 && e.empty()) {  // (MPI_Reduce_local counts in int)
      int chunk = static_cast<int>(std::min<size_t>(left, INT_MAX / 2));
      e = Check(MPI_Reduce_local(src, dst, chunk, t, sum), op, "MPI_Reduce_local");
      src += static_cast<size_t>(chunk) * ByteSize(c.kind);
      dst += static_cast<size_t>(chunk) * ByteSize(c.kind);
      left -= static_cast<size_t>(chunk);
    }
  }
  for (int j = 0; j < p.size; ++j) {  // the received rows' cotangents went back
    for (int s = 0; s < p.per; ++s) {
      int i = me * p.per + s;
      int64_t k = p.count(j, i);
      if (k > 0) std::memset(at(masked, p.dst[static_cast<size_t>(j) * n + i]), 0,
                             static_cast<size_t>(k) * row_bytes);
    }
  }
  return e;
}

}  // namespace vjpmpi
