%% The batcher's application and its supervisor: one batcher per gateway node.
-module(fedgate_uplink_batcher_app).
-behaviour(application).
-behaviour(supervisor).

-export([start/2, stop/1, init/1]).

start(_Type, _Args) ->
    supervisor:start_link({local, fedgate_uplink_batcher_sup}, ?MODULE, []).

stop(_State) ->
    ok.

init([]) ->
    %% the batcher reconnects by itself; a crash (a bug, a nack) restarts it from the
    %% queue: what it had not acked is delivered again
    {ok, {#{strategy => one_for_one, intensity => 10, period => 60},
          [#{id => fedgate_uplink_batcher,
             start => {fedgate_uplink_batcher, start_link, []},
             restart => permanent,
             shutdown => 5000,
             type => worker}]}}.
