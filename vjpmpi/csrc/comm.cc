// The communicator table (agree.h): vjpmpi's numbers for communicators, what happens
// when one is freed or MPI finalizes, and the communicator a program names (Resolve).
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "agree.h"
#include "async.h"
#include "runtime.h"

namespace vjpmpi {

// ------------------------------------------------------- communicators --
// MPI calls this when a communicator with a vjpmpi number is freed: its programs
// then fail (the number is never given to another communicator), and its window
// is freed with it (collectively: every rank frees the communicator).
void CloseChannel(Runtime& rt, CommEntry& e) {
  Channel* ch;
  {
    std::lock_guard<std::mutex> reading(rt.channel_mutex);  // (after the watchdog's read)
    ch = e.channel;
    if (ch == nullptr) return;
    e.channel = nullptr;
    if (rt.world.load() == &e) rt.world.store(nullptr);
  }
  {
    std::lock_guard<std::mutex> lock(rt.comms.mutex);
    auto& v = rt.open_channels;
    v.erase(std::remove(v.begin(), v.end(), &e), v.end());
  }
  MPI_Win_unlock_all(ch->win);
  MPI_Win_free(&ch->win);
  MPI_Comm_free(&ch->dup);
  delete ch;
}

int FreedComm(MPI_Comm, int, void* value, void*) {
  Runtime* rt = &runtime;
  CommEntry* e = rt->comms.Get(static_cast<int64_t>(reinterpret_cast<intptr_t>(value)));
  if (e == nullptr) return MPI_SUCCESS;
  e->comm.store(MPI_COMM_NULL, std::memory_order_release);
  CloseChannel(*rt, *e);
  StopCommThread(e->id);
  return MPI_SUCCESS;
}

// MPI_Finalize deletes MPI_COMM_SELF's attributes first: each window then says so (a
// rank that waits for this one to reach a collective learns that it never will), and
// the windows are freed, collectively, in the reverse of the order they were opened in
// (every rank opened its windows in an order that ran, so the reverse order runs too).
int Finalizing(MPI_Comm, int, void*, void*) {
  Runtime* rt = &runtime;
  std::vector<CommEntry*> open;
  {
    std::lock_guard<std::mutex> lock(rt->comms.mutex);
    open = rt->open_channels;
  }
  for (CommEntry* e : open) __atomic_store_n(&e->channel->header()->finalized, 1, __ATOMIC_RELEASE);
  // (MPI_Win_free is collective: every rank frees the windows in one order, the last
  // opened first)
  std::sort(open.begin(), open.end(), [](const CommEntry* a, const CommEntry* b) {
    return std::make_pair(a->close_key[0], a->close_key[1]) >
           std::make_pair(b->close_key[0], b->close_key[1]);
  });
  for (CommEntry* e : open) CloseChannel(*rt, *e);
  return MPI_SUCCESS;
}

// Whether `comm`'s processes are on more than one node, by Runtime::world_nodes (a
// process outside COMM_WORLD counts as another node; nodes not known: false). Local MPI
// calls only: a communicator's first use is no collective point.
bool SpansNodes(const Runtime& rt, MPI_Comm comm, int size) {
  if (size < 2 || rt.world_nodes.empty()) return false;
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(size), in_world(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  const int n = static_cast<int>(rt.world_nodes.size());
  auto node = [&](int w) { return w >= 0 && w < n ? rt.world_nodes[w] : -1; };
  for (int w : in_world) {
    if (node(w) < 0 || node(w) != node(in_world[0])) return true;
  }
  return false;
}

// Each rank's place in the default communicator `world` (CommEntry::in_world, group).
// Local MPI calls only.
void PlaceInWorld(CommEntry& e, MPI_Comm comm, MPI_Comm world) {
  MPI_Group group, all;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(world, &all);
  std::vector<int> ranks(e.size);
  e.in_world.assign(e.size, MPI_UNDEFINED);
  for (int i = 0; i < e.size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, e.size, ranks.data(), all, e.in_world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&all);
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (int& w : e.in_world) {
    if (w == MPI_UNDEFINED) w = -1;
    h = Mix(h, static_cast<uint64_t>(static_cast<int64_t>(w)));
  }
  e.group = h;
}

// vjpmpi's number for `comm` (given at its first use, kept on it as an attribute, so
// every mpi4py object of one communicator has the same number).
std::string CommNumber(Runtime& rt, MPI_Comm comm, int64_t* id) {
  std::call_once(rt.comm_keys, [&rt] {
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreedComm, &rt.comm_key, nullptr);
    int self_key = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, Finalizing, &self_key, nullptr);
    MPI_Comm_set_attr(MPI_COMM_SELF, self_key, nullptr);
  });
  void* value = nullptr;
  int found = 0;
  std::string e = Check(MPI_Comm_get_attr(comm, rt.comm_key, &value, &found), "comm",
                        "MPI_Comm_get_attr");
  if (!e.empty()) return e;
  if (found) {
    *id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
    return {};
  }
  std::lock_guard<std::mutex> lock(rt.comms.mutex);
  CommEntry* entry = rt.comms.Add();
  if (entry == nullptr) return "vjpmpi: too many communicators";
  MPI_Comm_size(comm, &entry->size);
  MPI_Comm_rank(comm, &entry->rank);
  entry->spans_nodes = SpansNodes(rt, comm, entry->size);
  if (CommEntry* world = rt.world.load()) PlaceInWorld(*entry, comm, world->comm.load());
  entry->comm.store(comm, std::memory_order_release);
  *id = entry->id;
  return Check(MPI_Comm_set_attr(comm, rt.comm_key, reinterpret_cast<void*>(
                                     static_cast<intptr_t>(entry->id))),
               "comm", "MPI_Comm_set_attr");
}

// The communicator a program names, if it is alive. A collective run on a Python
// thread (XLA runs a program on the thread that calls it unless it has work to hand
// to its own threads first) must run on the thread that owns the communicator: the
// first Python thread that traced or ran a collective on it (Python sets `owner`).
std::string Resolve(Runtime& rt, Call& c, int64_t id, bool collective, CommEntry** out) {
  CommEntry* e = rt.comms.Get(id);
  if (e == nullptr) {
    return std::string("vjpmpi.") + c.op + ": this program names communicator #" +
           std::to_string(id) + ", which vjpmpi has not been given in this process (a "
           "program exported or cached by another process? trace it again here)";
  }
  MPI_Comm comm = e->comm.load(std::memory_order_acquire);
  if (comm == MPI_COMM_NULL) {
    return std::string("vjpmpi.") + c.op + ": the communicator this program was traced "
           "with (vjpmpi's communicator #" + std::to_string(id) + ", of " +
           std::to_string(e->size) + " ranks) has been freed; trace the function again with "
           "a live communicator";
  }
  if (collective && OnPythonThread()) {
    uint64_t me = ThreadId(), owner = e->owner.load(std::memory_order_acquire);
    if (owner != 0 && owner != me) {
      return std::string("vjpmpi.") + c.op + ": " + ThreadError(me, owner, id, e->size);
    }
  }
  c.comm = comm;
  *out = e;
  return {};
}

}  // namespace vjpmpi
